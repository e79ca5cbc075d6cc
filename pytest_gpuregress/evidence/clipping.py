"""How often gradient clipping acted in a training record, read from its series and config. numpy only.

A clip that never acts leaves a wrong or skipped clip bit-identical, so a reference that almost never clipped
says so when it is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..findings import CheckFinding
from ..reference.record import RunRecord

if TYPE_CHECKING:
    import numpy as np

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


# The clip judged against its own norm. Three numbers a training record keeps per step: the gradients' global norm
# before the clip (from the per-parameter norms, computed by the plugin), the norm the clip itself reported, and the
# global norm after it. A clip is right when it reports the gradients' norm and scales them by
# min(1, max_norm / (reported + 1e-6)). Clean runs agree to about 2e-7 (every shipped reference, bf16 lane included,
# and 40 fault runs whose fault is not the clip's): the limit, 100 times that, sees a clip off by 5e-5, which fails
# the run's clipped_grad_norm tolerance (5.5e-7) and at 1e-4 decided nothing. Those models' largest gradient has at
# most CONSISTENCY_SIZE elements; the clip sums squares in float32, whose rounding error grows with the count
# summed (a 32k vocabulary's 2M-element head: 4.5e-5 clean), so a larger parameter widens the limit with the square
# root of its size (rounding errors add like a random walk: the 2M head's limit is 1.1e-4), up to CONSISTENCY_MAX,
# so that on a GPU-size head a clip off by a tenth of a percent still fails.
CONSISTENCY = 2e-5
CONSISTENCY_SIZE = 65536
CONSISTENCY_MAX = 1e-3


def consistency_limit(record: RunRecord) -> float:
    """The relative disagreement allowed between the clip's norm and the gradients' (CONSISTENCY, widened by the
    square root of the largest gradient's size where it is larger than CONSISTENCY_SIZE, at most CONSISTENCY_MAX).
    Sizes from the step-0 gradients kept: whole tensors, or the element counts of a large one's blocks (step0.py)."""
    from .step0 import BLOCK_PREFIX, FULL_PREFIX, LATE

    sizes = [array.size for name, array in record.arrays.items() if name.startswith((FULL_PREFIX, LATE[0]))]
    sizes += [int(array[:, 1].sum()) for name, array in record.arrays.items()
              if name.startswith((BLOCK_PREFIX, LATE[1])) and array.ndim == 2 and array.shape[1] > 1]
    widening = max(1.0, max(sizes, default=0) / CONSISTENCY_SIZE) ** 0.5
    return min(CONSISTENCY * widening, CONSISTENCY_MAX)


def problems(record: RunRecord) -> list[CheckFinding]:
    """Findings where the clip of some step is inconsistent with its own norm: it reported another
    norm than the gradients have (one taken on a shard reports about 1/sqrt(ranks) of it), or scaled the gradients
    by another coefficient than its norm asks for. [] where the record keeps no clip or no per-parameter norms."""
    import numpy as np

    clip = of(record)
    norms = record.arrays.get("param_grad_norm")
    after = record.series.get("clipped_grad_norm")
    if clip is None or norms is None or not after or len(after) != len(norms) or norms.ndim != 2:
        return []
    before = np.sqrt((np.asarray(norms, dtype=np.float64) ** 2).sum(axis=1))
    reported = np.asarray(record.series["grad_norm"], dtype=np.float64)[:len(before)]
    applied = np.asarray(after, dtype=np.float64) / np.where(before > 0, before, np.nan)
    asked = np.minimum(1.0, clip.max_norm / (reported + TORCH_EPS))
    out = []
    with np.errstate(divide="ignore", invalid="ignore"):
        norm_off = np.abs(reported - before) / before
        coefficient_off = np.abs(applied - asked) / asked
    limit = consistency_limit(record)
    wrong_norm = np.nonzero(norm_off > limit)[0]
    if len(wrong_norm):
        out.append(_another_norm(reported, before, wrong_norm))
    wrong_scale = np.nonzero(coefficient_off > limit)[0]
    if len(wrong_scale) and not len(wrong_norm):
        s = int(wrong_scale[0])
        out.append(CheckFinding("clip", f"the clip scaled the gradients by {applied[s]:.9g} at step {s}, where its own norm "
                   f"{reported[s]:.9g} and max_norm {clip.max_norm:g} ask for {asked[s]:.9g} (off by "
                   f"{coefficient_off[s]:.2g}); {len(wrong_scale)} of {len(before)} steps"))
    return out


def _another_norm(reported: np.ndarray, before: np.ndarray, wrong: np.ndarray) -> CheckFinding:
    """The finding for the steps ``wrong`` whose clip ``reported`` another norm than the gradients had ``before`` it;
    a shard's norm where the ratio says so."""
    s = int(wrong[0])
    ratio = reported[s] / before[s]
    shard = f"; about 1/sqrt({round(1 / ratio ** 2)}) of it, as a norm taken on one rank's shard is" \
        if ratio < 0.95 and round(1 / ratio ** 2) >= 2 else ""
    return CheckFinding("clip", f"the clip (clip_grad_norm_) reported another norm than its gradients have: at step "
                        f"{s} {reported[s]:.9g}, where the gradients it clipped have {before[s]:.9g} (ratio {ratio:.6g}"
                        f"{shard}); {len(wrong)} of {len(before)} steps")
