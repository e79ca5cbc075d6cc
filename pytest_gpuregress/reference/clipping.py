"""How often gradient clipping acted in a training record: read from its series and its config, never stored twice.

A clip that never acts leaves a wrong or skipped clip bit-identical, so a reference that clipped on almost no step
says so when it is recorded: its scenario's ``grad_clip`` should sit near the typical norm.
numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .record import RunRecord

# torch clips when max_norm / (total + 1e-6) < 1 (torch.nn.utils.clip_grad_norm_).
TORCH_EPS = 1e-6
# Below this share of the steps the clip checks too little of the update to be worth its name.
FEW = 0.1


@dataclass(frozen=True)
class Clipping:
    max_norm: float
    clipped: int
    steps: int

    def describe(self) -> str:
        return f"clipping acted on {self.clipped} of {self.steps} steps (max norm {self.max_norm:g})"

    def warning(self) -> str | None:
        """A recording note when the clip acts on too few steps to be exercised. (Acting on nearly every step is
        fine: torch multiplies by the clamped coefficient on every step, so the unclipped path is the same code.)"""
        if self.steps and self.clipped >= FEW * self.steps:
            return None
        return (f"{self.describe()}: the clip itself is barely exercised; set grad_clip near this model's typical "
                "gradient norm (docs/envelope.md)")


def of(record: RunRecord) -> Clipping | None:
    """The record's clipping, or None where it has no clip (a user's loop) or no gradient norms."""
    max_norm = record.config.get("grad_clip")
    norms = record.series.get("grad_norm")
    if max_norm is None or not norms:
        return None
    clipped = sum(1 for norm in norms if float(norm) + TORCH_EPS > float(max_norm))
    return Clipping(float(max_norm), clipped, len(norms))
