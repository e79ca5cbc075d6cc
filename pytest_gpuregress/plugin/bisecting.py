"""``--gpuregress-bisect`` for a failing training case: its step 0 rerun under overlays (triage/bisect.py).

Each experiment is one launch of the case's own config, one step, with the op trace, whose ranks start with an
overlay's ``PYTHONPATH`` (triage/overlays.py): the session's launcher pools them by their environment, so one
overlay's ranks serve every launch that needs it. Its step 0 is judged against the reference cut to step 0, in
the lane the comparison chooses: restored bit for bit in the exact lane; within the envelope, with no op of step
0 introducing a difference, in the tolerant lane.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from ..reference.compare import Comparison
from ..reference.failfast import truncated_reference
from ..reference.record import RunRecord
from ..scenarios import Case, Scenario, Setup
from ..stack.fingerprint import canonical, installed_packages
from ..triage import Experiment
from ..triage import bisect as bisection
from ..triage.overlays import BisectProblem, Overlays
from .launches import Runner


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
    if not isinstance(recorded, dict):
        return Experiment(bisection.NAME, "not applicable", "the reference was recorded before the whole environment "
                                                            "was kept: re-record it to have an upgrade bisected")
    first = min((f.step for f in comparison.findings if f.step is not None), default=None)
    if first not in (0, None):
        return Experiment(bisection.NAME, "not applicable", f"step 0 of this run matches the reference (the first "
                                                            f"difference is at step {first}): a bisect of step 0 has "
                                                            "nothing to restore")
    overlays = Overlays(request.root / "bisect", request.wheelhouse)
    found = bisection.plan(recorded, installed_packages(), requires,
                           lambda p, v: wheelhouse_has(request.wheelhouse, p, v), overlays.available)
    launch = next(launch for launch in sc.launches([case], setup) if launch.key == case.launch)
    cut = truncated_reference(reference, 1)

    def restores(reverted: list[bisection.Change]) -> bisection.Outcome:
        env = overlays.environment({c.package: str(c.reference_version) for c in reverted if c.kind != "added"},
                                   [c.package for c in reverted if c.kind == "added"])
        named = "-".join(sorted(f"{c.package}=={c.reference_version}" for c in reverted))
        key = f"bisect-{hashlib.sha256(named.encode()).hexdigest()[:12]}"
        record = run(sc, replace(launch, key=key, env={**launch.env, **env}, config={**launch.config, "steps": 1}))
        judged = sc.compare(cut, record, case, "auto")
        if judged.passed and (judged.lane == "exact" or judged.introduced is None):
            return bisection.Outcome(True, "bit for bit" if judged.lane == "exact"
                                     else "within the envelope, with no op of step 0 introducing a difference")
        worst = judged.findings[0].message if judged.findings else (
            judged.introduced.describe() if judged.introduced is not None else "the comparison failed")
        return bisection.Outcome(False, worst.split(";")[0])

    try:
        result = bisection.bisect(found, restores)
    except BisectProblem as exc:
        return Experiment(bisection.NAME, "failed to run", str(exc))
    except Exception as exc:  # noqa: BLE001 - an experiment that broke clears nothing, and must not hide the others
        lines = [line for line in str(exc).splitlines() if line.strip()][:12]
        return Experiment(bisection.NAME, "failed to run", f"{type(exc).__name__}: {lines[0] if lines else ''}",
                          lines=lines[1:])
    return bisection.experiment(result)
