"""What a training run shows of the stack besides its numbers, judged by the options' policy: kernel
changes since the reference, and throughput and memory as ratios to it. By default a kernel change is
reported and a slowdown warns (upgrades change kernels; shared machines are noisy). Host-op fallbacks
are the scenario's own findings, not judged here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..evidence import kernels
from ..findings import CheckFinding
from ..reference.record import RunRecord
from ..stack import fingerprint as fp
from . import perf
from .policy import JudgingPolicy


class GpuRegressPerfWarning(UserWarning):
    """A training scenario ran slower, or used more memory, than its reference (past the limits)."""


class GpuRegressKernelWarning(UserWarning):
    """Kernels changed since the reference; the numbers may still be fine."""


@dataclass
class Observations:
    kernel_changes: list[str] | None  # None: no inventory on one side (an older reference, or profiling off)
    ratios: list[perf.Ratio] | None
    perf_problems: list[str]
    policy: JudgingPolicy

    # Why the ratios are information only: the reference was timed on other hardware ("" when judged).
    perf_not_judged: str = ""
    # Who moved the op sequence, where a model library changed and torch did not ("" otherwise).
    kernel_cause: str = ""

    @classmethod
    def of(cls, reference: RunRecord, record: RunRecord, policy: JudgingPolicy) -> Observations:
        changes = kernels.changes(reference, record) if policy.kernel_changes != "off" else None
        ratios = None if policy.perf == "off" else perf.ratios(
            reference, record, slowdown=policy.perf_slowdown, memory=policy.perf_memory)
        cause = model_code_cause(reference, record)
        other_hardware = fp.hardware_diff(reference.fingerprint, record.fingerprint)
        if other_hardware:  # a step time from another CPU or GPU model says nothing about this stack
            why = "not judged: the reference was timed on other hardware (" + ", ".join(
                fp.describe_change(*c) for c in other_hardware) + ")"
            return cls(changes, ratios, [], policy, why, cause)
        return cls(changes, ratios, perf.problems(ratios, record, reference), policy, "", cause)

    def failures(self) -> list[CheckFinding]:
        """Findings that fail the test under the policy."""
        out: list[CheckFinding] = []
        if self.kernel_changes and self.policy.kernel_changes == "fail":
            lines = kernels.report_lines(self.kernel_changes, "; ".join(
                filter(None, [self.kernel_cause, "--gpuregress-kernel-changes=fail"])))
            out.append(CheckFinding("kernel-changes", "\n".join(lines)))
        if self.perf_problems and self.policy.perf == "fail":
            out += [CheckFinding("performance", f"{p} (--gpuregress-perf=fail)") for p in self.perf_problems]
        return out

    def warnings(self) -> list[tuple[type[Warning], str]]:
        """Warnings for what is reported but does not fail."""
        out: list[tuple[type[Warning], str]] = []
        if self.kernel_changes and self.policy.kernel_changes == "report":
            out.append((GpuRegressKernelWarning, "\n".join(kernels.report_lines(self.kernel_changes, self.kernel_cause))))
        if self.perf_problems and self.policy.perf == "warn":
            out += [(GpuRegressPerfWarning, p + " (--gpuregress-perf=fail to fail on it)") for p in self.perf_problems]
        return out

    def evidence(self) -> list[str]:
        """The kernel changes, to sit next to a numeric deviation in its failure report."""
        if self.kernel_changes is None:
            return ["kernels: not compared (no inventory on one side: a reference from before inventories, a run "
                    "that stopped before its profiled step, a loop that takes none, or --gpuregress-kernel-changes=off)"]
        return kernels.report_lines(self.kernel_changes, self.kernel_cause) or ["kernels: the same as in the reference"]

    def detail(self) -> str:
        """For the terminal summary: the ratios and the count of changed kernels."""
        parts = []
        if self.ratios:
            judged = f" ({self.perf_not_judged})" if self.perf_not_judged else ""
            parts.append("perf vs reference: " + perf.summary(self.ratios) + judged)
        if self.kernel_changes is not None:
            parts.append(f"kernels changed: {len(self.kernel_changes)}")
        elif self.policy.kernel_changes != "off":  # say so: =fail cannot fail on what was never compared
            parts.append("kernels not compared (no inventory on one side)")
        return "; ".join(parts)


def model_code_cause(reference: RunRecord, record: RunRecord) -> str:
    """"the model's code changed with transformers 5.24.0 -> 4.57.6 ...": where a model library changed and torch
    did not, a changed op sequence is the model's own code (the model component), not a kernel library."""
    from ..evidence.model_layout import MODEL_LIBRARIES, library_changes

    changed = library_changes(reference, record)
    model_fields = {f"versions.{library}" for library in MODEL_LIBRARIES if library != "torch"}
    others = [key for key, _, _ in fp.diff(reference.fingerprint, record.fingerprint) if key not in model_fields]
    if not changed or others:  # torch, a kernel library, the driver or the hardware moved too: the kernels may be theirs
        return ""
    return (f"the model's code changed with {', '.join(changed)}: the op sequence of a step moved with it, "
            "not a kernel library (the model component)")
