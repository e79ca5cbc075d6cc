"""Bisect an upgrade to the package: revert what changed since the reference, in overlays, and rerun step 0.

The changed distributions that an overlay can replace (not torch's ABI, editable installs, this plugin) are
grouped with what they require, reverted together, then halved while a half restores step 0 (bit for bit, or
within the envelope with no op introducing a difference). docs/triage.md, "Bisect an upgrade to the package". torch-free.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..comparison.compare import Comparison
from ..comparison.failfast import truncated_reference
from ..reference.record import RunRecord
from ..stack.fingerprint import canonical, installed_packages
from . import Experiment, Runner
from .overlays import BisectProblem, Overlays

if TYPE_CHECKING:
    from ..scenarios import Case, Scenario, Setup

NAME = "bisect"  # the experiment's name in the verdict (triage/decision.py's first rule)
# Packages built against torch's C++ ABI or shipping its native libraries: a wheel of another version on the path
# beside this torch would load the wrong binaries, so an overlay never replaces them (but torch itself, where the
# wheelhouse holds its reference version).
TORCH_ABI = ("torch", "torchvision", "torchaudio", "torchtext", "pytorch-triton", "pytorch-triton-rocm",
             "pytorch-triton-xpu", "triton", "flash-attn", "flash-attn-3", "xformers", "apex", "fbgemm-gpu",
             "fbgemm-gpu-genai", "torchao", "transformer-engine", "transformer-engine-torch", "deepspeed",
             "mamba-ssm", "causal-conv1d", "bitsandbytes", "torch-tensorrt")
TORCH_ABI_PREFIXES = ("nvidia-", "rocm-", "transformer-engine", "flash-attn")
OURS = "pytest-gpuregress"


@dataclass(frozen=True)
class Change:
    """One distribution that differs: ``then`` the reference's version (None: added since), ``now`` this stack's
    (None: removed since). Versions as the fingerprint keeps them ("1.2.0 (editable)")."""

    package: str
    then: str | None
    now: str | None

    @property
    def kind(self) -> Literal["changed", "added", "removed"]:
        return "added" if self.then is None else "removed" if self.now is None else "changed"

    @property
    def reference_version(self) -> str | None:
        return self.then.split(" ", 1)[0] if self.then else None

    def describe(self) -> str:
        if self.kind == "added":
            return f"{self.package} (added)"
        if self.kind == "removed":
            return f"{self.package} (removed)"
        return f"{self.package} {self.now} -> {self.then}"  # the way a revert goes


@dataclass(frozen=True)
class Plan:
    groups: list[list[Change]]  # what may be reverted, one group at a time
    grouped: list[str]  # why packages went into one group
    untested: list[tuple[Change, str]]  # what an overlay cannot replace, and why


def changes(reference: dict[str, str], current: dict[str, str]) -> list[Change]:
    """The distributions that differ between two fingerprints' ``packages`` sections."""
    return [Change(p, reference.get(p), current.get(p)) for p in sorted(set(reference) | set(current))
            if reference.get(p) != current.get(p)]


def why_untestable(change: Change, wheelhouse_has: Callable[[str, str], bool] = lambda p, v: False) -> str | None:
    """Why an overlay cannot revert ``change``; None where it can."""
    if change.package == OURS:
        return "the plugin running the experiment"
    if change.then and change.then.endswith(("(editable)", "(local)", "(vcs)")):
        return f"the reference's was installed from a folder or a file ({change.then}): there is no wheel of it to fetch"
    if change.now and change.now.endswith("(editable)"):
        return f"installed editable here ({change.now}): its import hook comes before any folder on the path"
    torch_built = change.package in TORCH_ABI or change.package.startswith(TORCH_ABI_PREFIXES)
    if torch_built and not (change.package == "torch" and change.reference_version
                            and wheelhouse_has("torch", change.reference_version)):
        return ("torch itself (a wheelhouse holding its reference version lets an overlay replace it)"
                if change.package == "torch" else "built against torch's ABI: it cannot be swapped beside this torch")
    return None


def plan(reference: dict[str, str], current: dict[str, str], requires: Callable[[str], Iterable[str]],
         wheelhouse_has: Callable[[str, str], bool] = lambda p, v: False,
         fetch: Callable[[str, str], str | None] = lambda p, v: None) -> Plan:
    """What to revert, in groups (a package with the added ones it requires), and what cannot be. ``fetch`` gets
    the reference's version of a package ahead of the experiments, and says why it cannot be had (then that package
    is not tested, with the reason), or None."""
    found = changes(reference, current)
    untested = [(c, why) for c in found if (why := why_untestable(c, wheelhouse_has)) is not None]
    testable = [c for c in found if why_untestable(c, wheelhouse_has) is None]
    missing = [(c, why) for c in testable if c.kind != "added" and (why := fetch(c.package, str(c.reference_version)))]
    untested += missing
    testable = [c for c in testable if c not in {m for m, _ in missing}]
    groups, grouped = _grouped_with_what_they_require(testable, requires)
    return Plan(groups, grouped, untested)


def _grouped_with_what_they_require(testable: list[Change], requires: Callable[[str], Iterable[str]]
                                    ) -> tuple[list[list[Change]], list[str]]:
    """The changes in groups: a package reverted together with the added packages it requires (the reference had
    none, so its older version could not import without them), transitively; and a line per such grouping."""
    added = {c.package for c in testable if c.kind == "added"}
    group_of = {c.package: c.package for c in testable}

    def root(p: str) -> str:
        while group_of[p] != p:
            p = group_of[p]
        return p

    grouped = []
    for change in (c for c in testable if c.kind != "removed"):
        needs = sorted(added & {canonical(r) for r in requires(change.package)} - {change.package})
        for need in needs:
            group_of[root(need)] = root(change.package)
        if needs:
            grouped.append(f"{change.package} with {', '.join(needs)} (it requires {'it' if len(needs) == 1 else 'them'}, "
                           "and the reference had none)")
    by_root: dict[str, list[Change]] = {}
    for change in testable:
        by_root.setdefault(root(change.package), []).append(change)
    return list(by_root.values()), grouped


@dataclass(frozen=True)
class Outcome:
    restored: bool
    how: str  # "bit for bit", "within the envelope, with the introducing op gone", or what still differs


@dataclass
class Result:
    plan: Plan
    culprit: list[Change] | None  # the smallest group whose revert restores step 0; None where none does
    how: str
    experiments: int
    seconds: float
    log: list[str] = field(default_factory=list)  # one line per experiment

    @property
    def package(self) -> str | None:
        """The package the verdict names: the culprit group's first changed (else added) package."""
        if not self.culprit:
            return None
        first = next((c for c in self.culprit if c.kind == "changed"), self.culprit[0])
        return first.package

    def line(self) -> str:
        """The report's ``bisect:`` line."""
        tried = f"({self.experiments} experiment{'s' if self.experiments != 1 else ''}, {self.seconds:.0f} s)"
        untested = "; not tested: " + ", ".join(f"{c.describe()} ({why})" for c, why in self.plan.untested) \
            if self.plan.untested else ""
        if not self.plan.groups:
            return f"bisect: no changed package can be overlaid, so nothing was tried{untested}"
        if self.culprit is None:
            return (f"bisect: no revert restores step 0: with every package an overlay can revert reverted, step 0 "
                    f"still differs ({self.how}); what remains is what cannot be overlaid (torch, the driver, the "
                    f"hardware){untested} {tried}")
        cleared = [c for g in self.plan.groups if g is not self.culprit for c in g]
        named = " and ".join(c.describe() for c in self.culprit)
        clear = f"; {' and '.join(c.describe() for c in cleared)} cleared" if cleared else ""
        return f"bisect: {named} restores step 0 {self.how}{clear} {tried}{untested}"


Restores = Callable[[list[Change]], Outcome]


def bisect(found: Plan, restores: Restores) -> Result:
    """Revert every group, then halves of the groups, as far as a smaller set still restores step 0."""
    started = time.monotonic()
    log: list[str] = []
    count = 0

    def tried(groups: list[list[Change]]) -> Outcome:
        nonlocal count
        count += 1
        outcome = restores([c for g in groups for c in g])
        reverted = ", ".join(c.describe() for g in groups for c in g)
        log.append(f"experiment {count}: reverted {reverted}: "
                   f"{'restores step 0 ' + outcome.how if outcome.restored else 'still differs: ' + outcome.how}")
        return outcome

    if not found.groups:
        return Result(found, None, "", 0, 0.0, log)
    everything = tried(found.groups)
    if not everything.restored:
        return Result(found, None, everything.how, count, time.monotonic() - started, log)
    candidates, how = found.groups, everything.how
    while len(candidates) > 1:
        half, rest = candidates[:len(candidates) // 2], candidates[len(candidates) // 2:]
        outcome = tried(half)
        if outcome.restored:
            candidates, how = half, outcome.how
            continue
        outcome = tried(rest)
        if outcome.restored:
            candidates, how = rest, outcome.how
            continue
        break  # neither half alone: the packages of both act together
    culprit = [c for g in candidates for c in g]
    result = Result(found, culprit, how, count, time.monotonic() - started, log)
    # The culprit as one group, for the line: the groups it spans are named together.
    result.plan = Plan([culprit, *[g for g in found.groups if not any(c in culprit for c in g)]], found.grouped,
                       found.untested)
    result.culprit = result.plan.groups[0]
    return result


def experiment(result: Result) -> Experiment:
    """The bisect's evidence for the verdict: the library whose revert restores step 0, or that none does."""
    lines = [*(f"grouped: {why}" for why in result.plan.grouped), *result.log]
    said = result.line().removeprefix("bisect: ")
    if result.package is None:
        return Experiment(NAME, "no revert restores", said, lines=lines)
    return Experiment(NAME, "named", said, component=f"library: {result.package}", lines=lines)


@dataclass(frozen=True)
class BisectRequest:
    """What --gpuregress-bisect was given: where overlays go (the artifacts folder), and the wheelhouse."""

    root: Path
    wheelhouse: Path | None = None


def requires(package: str) -> list[str]:
    """The distributions ``package`` requires as installed (extras left out)."""
    try:
        listed = metadata.requires(package) or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for requirement in listed:
        if re.search(r"\bextra\s*==", requirement):  # an extra's requirement: not what the package needs to run
            continue
        found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        if found:
            out.append(canonical(found.group(1)))
    return out


def wheelhouse_has(wheelhouse: Path | None, package: str, version: str) -> bool:
    """Whether the wheelhouse holds a wheel of ``package==version`` (by its file name)."""
    if wheelhouse is None or not wheelhouse.is_dir():
        return False
    stem = f"{package.replace('-', '_')}-{version}-".lower()
    return any(f.name.lower().startswith(stem) and f.suffix == ".whl" for f in wheelhouse.iterdir())


def bisect_failure(sc: Scenario, setup: Setup, run: Runner, reference: RunRecord, comparison: Comparison,
                   case: Case, request: BisectRequest) -> Experiment:
    """The bisect's evidence for a failed comparison of ``case``: named (a package or group restores step 0), or
    why it named none."""
    recorded = reference.fingerprint.get("packages")
    if not isinstance(recorded, dict):  # a plug-in's rank that set a fingerprint of its own
        return Experiment(NAME, "not applicable", "the reference keeps no list of installed packages to bisect")
    first = min((f.step for f in comparison.findings if f.step is not None), default=None)
    if first not in (0, None):
        return Experiment(NAME, "not applicable", f"step 0 of this run matches the reference (the first "
                                                            f"difference is at step {first}): a bisect of step 0 has "
                                                            "nothing to restore")
    overlays = Overlays(request.root / "bisect", request.wheelhouse)
    found = plan(recorded, installed_packages(), requires,
                           lambda p, v: wheelhouse_has(request.wheelhouse, p, v), overlays.available)
    launch = next(launch for launch in sc.launches([case], setup) if launch.key == case.launch)
    cut = truncated_reference(reference, 1)

    def restores(reverted: list[Change]) -> Outcome:
        env = overlays.environment({c.package: str(c.reference_version) for c in reverted if c.kind != "added"},
                                   [c.package for c in reverted if c.kind == "added"])
        named = "-".join(sorted(f"{c.package}=={c.reference_version}" for c in reverted))
        key = f"bisect-{hashlib.sha256(named.encode()).hexdigest()[:12]}"
        record = run(sc, replace(launch, key=key, env={**launch.env, **env}, config={**launch.config, "steps": 1}))
        judged = sc.compare(cut, record, case, "auto")
        if judged.passed and (judged.lane == "exact" or judged.introduced is None):
            return Outcome(True, "bit for bit" if judged.lane == "exact"
                                     else "within the envelope, with no op of step 0 introducing a difference")
        worst = judged.findings[0].message if judged.findings else (
            judged.introduced.describe() if judged.introduced is not None else "the comparison failed")
        return Outcome(False, worst.split(";")[0])

    try:
        result = bisect(found, restores)
    except BisectProblem as exc:
        return Experiment(NAME, "failed to run", str(exc))
    except Exception as exc:  # noqa: BLE001 - an experiment that broke clears nothing, and must not hide the others
        lines = [line for line in str(exc).splitlines() if line.strip()][:12]
        return Experiment(NAME, "failed to run", f"{type(exc).__name__}: {lines[0] if lines else ''}",
                          lines=lines[1:])
    return experiment(result)
