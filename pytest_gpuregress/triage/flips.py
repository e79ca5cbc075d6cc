"""Switches flipped: re-run a failing training scenario with one switch changed at a time, and say whether
the deviation (the tolerant lane's largest margin) vanished, shrank (to under a third) or stayed. A switch
that does not apply on this platform is listed with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..comparison.compare import Comparison, compare_training
from ..errors import NotApplicable
from ..evidence.op_trace import TRACE_CONFIG
from ..reference.record import RunRecord
from ..training.step import EMULATE_WORLD
from . import Experiment, Runner

if TYPE_CHECKING:
    from ..scenarios.base import Scenario, Setup

SHRANK = 3.0  # a deviation at least this many times smaller counts as shrunk


@dataclass(frozen=True)
class Switch:
    label: str
    component: str  # what a vanished deviation points at
    env: dict[str, str] = field(default_factory=dict)
    config: dict[str, object] = field(default_factory=dict)
    world_size: int | None = None
    not_applicable: str = ""  # the reason, when the switch does not apply here


def switches(setup: Setup) -> list[Switch]:
    if setup.device_kind == "cuda":
        return [
            Switch("NCCL_PROTO=Simple", "collective", env={"NCCL_PROTO": "Simple"}),
            Switch("NCCL_ALGO=Ring", "collective", env={"NCCL_ALGO": "Ring"}),
            Switch("the other BLAS library", "kernel", config={"blas_library": "other"}),
            Switch("SDPA math backend", "kernel", config={"sdpa_backend": "math"}),
            Switch("TF32 off", "kernel", not_applicable="the determinism switches already turn TF32 off"),
            Switch("reduced-precision reductions off", "kernel", config={"reduced_precision_reduction": False}),
        ]
    from ..training.noise import lower_cpu_capability

    lower = lower_cpu_capability()
    return [
        Switch(f"ATEN_CPU_CAPABILITY={lower}", "kernel", env={"ATEN_CPU_CAPABILITY": lower}) if lower else
        Switch("a lower ATEN_CPU_CAPABILITY", "kernel", not_applicable="this CPU already runs the default kernels"),
        Switch("one thread per rank", "kernel", not_applicable="ranks already run one thread each"),
        # One rank running each rank's micro-batch in turn, with their shapes: only the communication is gone.
        Switch("world size 1", "collective", config={EMULATE_WORLD: setup.world_size}, world_size=1),
    ]


def _worst(comparison: Comparison) -> float:
    return max(comparison.margins.values(), default=0.0)


def flip(sc: Scenario, setup: Setup, run: Runner, reference: RunRecord, failing: Comparison,
         model: str | None = None) -> list[Experiment]:
    from ..scenarios.base import Launch

    base = sc.model_config(setup, model)
    suffix = f"-{model}" if model else ""
    before = _worst(failing)
    if before <= 1.0:  # an exact-lane failure inside the tolerant limits: every flip would "vanish"
        return [Experiment("flips", "not applicable", f"the failure is {before:.3g}x its tolerant-lane limit, inside "
                                                       "it, so a flipped switch cannot be measured against it")]
    out: list[Experiment] = []
    for switch in switches(setup):
        if switch.not_applicable:
            out.append(Experiment(f"flip {switch.label}", "not applicable", switch.not_applicable))
            continue
        config = {**base, **switch.config, TRACE_CONFIG: False}  # judged by its deviation, not op by op
        launch = Launch(f"flip-{switch.label}{suffix}", config, dict(switch.env), world_size=switch.world_size,
                        cold=True)
        try:
            flipped = run(sc, launch)
        except NotApplicable as exc:
            out.append(Experiment(f"flip {switch.label}", "not applicable", str(exc)))
            continue
        except Exception as exc:  # noqa: BLE001 - a switch that breaks the run is evidence too, not a crash
            out.append(Experiment(f"flip {switch.label}", "failed to run", str(exc).splitlines()[0]))
            continue
        after_cmp = compare_training(reference, flipped, lane="tolerant")
        after = _worst(after_cmp)
        status = "vanished" if after_cmp.passed else ("shrank" if after * SHRANK < before else "stayed")
        out.append(Experiment(f"flip {switch.label}", status, f"worst deviation {before:.3g}x -> {after:.3g}x its limit",
                              component=switch.component if status == "vanished" else None))
    # Only a flip that vanished convicts its switch: the control that can overrule it runs only then (a cold launch).
    if any(e.status == "vanished" for e in out):
        control = _cold_control(sc, run, reference, base, suffix)
        if control is not None:
            return [control]
    return out


def _cold_control(sc: Scenario, run: Runner, reference: RunRecord, base: dict[str, object],
                  suffix: str) -> Experiment | None:
    """The same run in a fresh process with nothing flipped: where it passes, the failure needs a warmed-up process
    (a buffer pool, a counter), and every flipped run, as fresh, would "vanish" and convict its switch wrongly. The
    experiment then says so instead; None where the control still fails (the flips are measured) or did not run."""
    from ..scenarios.base import Launch

    try:
        plain = run(sc, Launch(f"flip-none{suffix}", {**base, TRACE_CONFIG: False}, cold=True))
    except Exception:  # noqa: BLE001 - without the control the flips are measured as before
        return None
    if not compare_training(reference, plain, lane="tolerant").passed:
        return None
    return Experiment("flips", "not applicable", "the same run in a fresh process with nothing flipped passes: the "
                      "failure needs a warmed-up process (a reused buffer, a counter), so a flipped run, as fresh, "
                      "would pass whatever it flips")
