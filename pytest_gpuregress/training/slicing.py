"""A rank's share of a step's global batch: a contiguous slice, whatever the data's source (data.py, token_file.py).

The global batch of a step is fixed, so changing the world size changes who computes what, not what is computed.
"""

from __future__ import annotations

import numpy as np


def rank_slice(batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's contiguous slice of a step's global batch."""
    if len(batch) % world_size:
        raise ValueError(
            f"global batch {len(batch)} is not divisible by world size {world_size}; "
            "choose a world size that divides it or change the model's global_batch"
        )
    per_rank = len(batch) // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]
