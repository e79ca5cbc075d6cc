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
from .decision import first_step
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
        if self.kind == "changed":
            return f"{self.package} {self.now} -> {self.then}"  # the way a revert goes
        return f"{self.package} ({self.kind})"


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
    then, now = change.then or "", change.now or ""
    if change.package == OURS:
        return "the plugin running the experiment"
    if then.endswith(("(editable)", "(local)", "(vcs)")):
        return f"the reference's was installed from a folder or a file ({then}): there is no wheel of it to fetch"
    if now.endswith("(editable)"):
        return f"installed editable here ({now}): its import hook comes before any folder on the path"
    return _torch_built(change, wheelhouse_has)


def _torch_built(change: Change, wheelhouse_has: Callable[[str, str], bool]) -> str | None:
    """Why a package built against torch cannot be overlaid; torch itself can, from a wheelhouse holding its version."""
    version = change.reference_version
    if change.package == "torch":
        return None if version and wheelhouse_has("torch", version) else \
            "torch itself (a wheelhouse holding its reference version lets an overlay replace it)"
    if change.package in TORCH_ABI or change.package.startswith(TORCH_ABI_PREFIXES):
        return "built against torch's ABI: it cannot be swapped beside this torch"
    return None


def plan(reference: dict[str, str], current: dict[str, str], requires: Callable[[str], Iterable[str]],
         wheelhouse_has: Callable[[str, str], bool] = lambda p, v: False,
         fetch: Callable[[str, str], str | None] = lambda p, v: None) -> Plan:
    """What to revert, in groups (a package with the added ones it requires), and what cannot be. ``fetch`` gets
    the reference's version of a package ahead of the experiments, and says why it cannot be had (then that package
    is not tested, with the reason), or None."""
    found = changes(reference, current)
    untested = {c: why for c in found if (why := why_untestable(c, wheelhouse_has))}
    missing = {c: why for c in found if c not in untested and c.kind != "added"
               and (why := fetch(c.package, str(c.reference_version)))}
    testable = [c for c in found if c not in untested and c not in missing]
    groups, grouped = _grouped_with_what_they_require(testable, requires)
    return Plan(groups, grouped, [*untested.items(), *missing.items()])


def _grouped_with_what_they_require(testable: list[Change], requires: Callable[[str], Iterable[str]]
                                    ) -> tuple[list[list[Change]], list[str]]:
    """The changes in groups: a package reverted together with the added packages it requires (the reference had
    none, so its older version could not import without them), transitively; and a line per such grouping."""
    needs = _added_required(testable, requires)
    group_of = {c.package: c.package for c in testable}  # a package -> one in its group, up to the group's root
    for package, required in needs.items():
        for need in required:
            group_of[_root(group_of, need)] = _root(group_of, package)
    grouped = [f"{package} with {', '.join(required)} (it requires {'it' if len(required) == 1 else 'them'}, and the "
               "reference had none)" for package, required in needs.items() if required]
    by_root: dict[str, list[Change]] = {}
    for change in testable:
        by_root.setdefault(_root(group_of, change.package), []).append(change)
    return list(by_root.values()), grouped


def _added_required(testable: list[Change], requires: Callable[[str], Iterable[str]]) -> dict[str, list[str]]:
    """Per package still installed, the added packages among ``testable`` that it requires."""
    added = {c.package for c in testable if c.kind == "added"}
    return {c.package: sorted(added & {canonical(r) for r in requires(c.package)} - {c.package})
            for c in testable if c.kind != "removed"}


def _root(group_of: dict[str, str], package: str) -> str:
    while group_of[package] != package:
        package = group_of[package]
    return package


@dataclass(frozen=True)
class Outcome:
    restored: bool
    how: str  # "bit for bit", "within the envelope, with the introducing op gone", or what still differs


@dataclass
class Result:
    plan: Plan
    culprit: list[Change] | None  # the smallest group whose revert restores step 0 (plan's first); None where none does
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
        cleared = [c for g in self.plan.groups[1:] for c in g]
        clear = f"; {_named(cleared)} cleared" if cleared else ""
        return f"bisect: {_named(self.culprit)} restores step 0 {self.how}{clear} {tried}{untested}"


def _named(reverted: Iterable[Change]) -> str:
    return " and ".join(c.describe() for c in reverted)


Restores = Callable[[list[Change]], Outcome]


def bisect(found: Plan, restores: Restores) -> Result:
    """Revert every group, then halves of the groups, as far as a smaller set still restores step 0."""
    started = time.monotonic()
    log: list[str] = []  # one line per experiment

    def tried(groups: list[list[Change]]) -> Outcome:
        reverted = [c for g in groups for c in g]
        outcome = restores(reverted)
        said = f"restores step 0 {outcome.how}" if outcome.restored else f"still differs: {outcome.how}"
        log.append(f"experiment {len(log) + 1}: reverted {', '.join(map(Change.describe, reverted))}: {said}")
        return outcome

    if not found.groups:
        return Result(found, None, "", 0, 0.0, log)
    everything = tried(found.groups)
    if not everything.restored:
        return Result(found, None, everything.how, len(log), time.monotonic() - started, log)
    candidates, how = _narrowed(found.groups, everything.how, tried)
    culprit = [c for g in candidates for c in g]
    # The culprit as one group, first, for the line: the groups it spans are named together.
    groups = [culprit, *[g for g in found.groups if not any(c in culprit for c in g)]]
    return Result(replace(found, groups=groups), culprit, how, len(log), time.monotonic() - started, log)


def _narrowed(candidates: list[list[Change]], how: str, tried: Callable[[list[list[Change]]], Outcome]
              ) -> tuple[list[list[Change]], str]:
    """Halve ``candidates`` (whose revert restores step 0, ``how``) while one half alone still does: the smallest such
    set of groups, and how its revert restores step 0."""
    while len(candidates) > 1:
        half, rest = candidates[:len(candidates) // 2], candidates[len(candidates) // 2:]
        outcome = tried(half)
        if not outcome.restored:
            half, outcome = rest, tried(rest)
        if not outcome.restored:
            break  # neither half alone: the packages of both act together
        candidates, how = half, outcome.how
    return candidates, how


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
    # An extra's requirement is not what the package needs to run.
    found = (re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r) for r in listed if not re.search(r"\bextra\s*==", r))
    return [canonical(name.group(1)) for name in found if name]


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
    first = first_step(comparison)
    if first:
        return Experiment(NAME, "not applicable", f"step 0 of this run matches the reference (the first "
                                                  f"difference is at step {first}): a bisect of step 0 has "
                                                  "nothing to restore")
    overlays = Overlays(request.root / "bisect", request.wheelhouse)
    found = plan(recorded, installed_packages(), requires, lambda p, v: wheelhouse_has(request.wheelhouse, p, v),
                 overlays.available)
    launch = next(launch for launch in sc.launches([case], setup) if launch.key == case.launch)
    cut = truncated_reference(reference, 1)

    def restores(reverted: list[Change]) -> Outcome:
        env = overlays.environment({c.package: str(c.reference_version) for c in reverted if c.kind != "added"},
                                   [c.package for c in reverted if c.kind == "added"])
        named = "-".join(sorted(f"{c.package}=={c.reference_version}" for c in reverted))
        key = f"bisect-{hashlib.sha256(named.encode()).hexdigest()[:12]}"
        record = run(sc, replace(launch, key=key, env={**launch.env, **env}, config={**launch.config, "steps": 1}))
        return _outcome(sc.compare(cut, record, case, "auto"))

    try:
        result = bisect(found, restores)
    except BisectProblem as exc:
        return Experiment(NAME, "failed to run", str(exc))
    except Exception as exc:  # noqa: BLE001 - an experiment that broke clears nothing, and must not hide the others
        lines = [line for line in str(exc).splitlines() if line.strip()][:12]
        return Experiment(NAME, "failed to run", f"{type(exc).__name__}: {lines[0] if lines else ''}",
                          lines=lines[1:])
    return experiment(result)


def _outcome(judged: Comparison) -> Outcome:
    """What step 0 with some packages reverted says: restored bit for bit (the exact lane), or within the envelope
    with no op introducing a difference; else what still differs."""
    if judged.passed and (judged.lane == "exact" or judged.introduced is None):
        return Outcome(True, "bit for bit" if judged.lane == "exact"
                             else "within the envelope, with no op of step 0 introducing a difference")
    worst = judged.findings[0].message if judged.findings else (
        judged.introduced.describe() if judged.introduced is not None else "the comparison failed")
    return Outcome(False, worst.split(";")[0])
