"""Step-0 gradients in a form that scales: full tensors up to ``FULL_MAX_ELEMENTS``, else one row per
``BLOCK`` of [block index, count, sum, sum of |x|, max |x|] (float64). numpy only.

One wrong element moves its block's sum by exactly its error, so it still shows, located to its block.
Each rank summarizes its own shard with blocks numbered in the full tensor; ``merge_ranks`` joins them.
``step0_deviation`` measures a run's against a reference's, per element or per block.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..reference.record import RunRecord

FULL_PREFIX = "step0_grad/"
BLOCK_PREFIX = "step0_blocks/"
STEP0 = (FULL_PREFIX, BLOCK_PREFIX)
# The same form for the gradients of a resumed run's first step (its checkpoint's step S, late in the run): a
# continuation from the reference's own state computes them from exactly the state the reference had, so they
# are judged as step 0's are (scenarios/shared/late_gradients.py).
LATE = ("late_grad/", "late_blocks/")
FULL_MAX_ELEMENTS = 1 << 16  # 256 KiB of float32: every tensor of the CPU model stays whole
BLOCK = 1024  # elements: 4 KiB of float32
_INDEX, _COUNT, _SUM, _ABS_SUM, _MAX_ABS = range(5)


def summarize(flat: np.ndarray, global_offset: int = 0, block: int = BLOCK) -> np.ndarray:
    """Block rows of ``flat``, whose first element is element ``global_offset`` of the full tensor.

    Sums accumulate in float64 without a float64 copy of the shard (it can be 300 MB)."""
    values = np.asarray(flat).reshape(-1)
    if values.size == 0:
        return np.zeros((0, 5))
    first_boundary = (-global_offset) % block  # elements before it finish a block begun on the previous rank
    starts = np.arange(first_boundary, values.size, block)
    if first_boundary:
        starts = np.concatenate([[0], starts[starts < values.size]])
    rows = np.empty((len(starts), 5))
    rows[:, _INDEX] = (global_offset + starts) // block
    rows[:, _COUNT] = np.diff(np.append(starts, values.size))
    rows[:, _SUM] = np.add.reduceat(values, starts, dtype=np.float64)
    magnitude = np.abs(values)
    rows[:, _ABS_SUM] = np.add.reduceat(magnitude, starts, dtype=np.float64)
    rows[:, _MAX_ABS] = np.maximum.reduceat(magnitude, starts)
    return rows


def combine(parts: list[np.ndarray]) -> np.ndarray:
    """One row per block from several ranks' rows: a block cut by a shard edge is added back together."""
    rows = np.concatenate([p for p in parts if p.size] or [np.zeros((0, 5))])
    if not rows.size:
        return rows
    order = np.argsort(rows[:, _INDEX], kind="stable")
    rows = rows[order]
    starts = np.concatenate([[0], np.nonzero(np.diff(rows[:, _INDEX]))[0] + 1])
    out = np.empty((len(starts), 5))
    out[:, _INDEX] = rows[starts, _INDEX]
    for col in (_COUNT, _SUM, _ABS_SUM):
        out[:, col] = np.add.reduceat(rows[:, col], starts)
    out[:, _MAX_ABS] = np.maximum.reduceat(rows[:, _MAX_ABS], starts)
    return out


def shard_arrays(name: str, local: np.ndarray, full_shape: tuple[int, ...], rank: int, world_size: int,
                 full_max: int = FULL_MAX_ELEMENTS, prefixes: tuple[str, str] = STEP0) -> dict[str, np.ndarray]:
    """What one rank records of its dim-0 shard ``local`` of a gradient shaped ``full_shape``, under ``prefixes``
    (whole, blocks)."""
    numel = int(np.prod(full_shape)) if full_shape else 1
    if numel <= full_max:
        # A copy: on the CPU ``local`` may share memory with the live gradient, which clipping scales next.
        return {prefixes[0] + name: np.array(local, copy=True)}
    return {prefixes[1] + name: summarize(local, shard_offset(full_shape, rank, world_size), BLOCK)}


def full_max_of(config: dict) -> int:
    """The whole-tensor threshold of a run: the default, or ``step0_full_max_elements`` (tests set it low)."""
    return int(config.get("step0_full_max_elements", FULL_MAX_ELEMENTS))


def shard_offset(full_shape: tuple[int, ...], rank: int, world_size: int) -> int:
    """Flat index of the first element of ``rank``'s FSDP2 shard (torch.chunk along dim 0)."""
    rows = full_shape[0] if full_shape else 1
    per_row = int(np.prod(full_shape[1:])) if len(full_shape) > 1 else 1
    chunk = -(-rows // world_size)
    return min(rank * chunk, rows) * per_row


def merge_ranks(records: list[RunRecord], prefixes: tuple[str, str] = STEP0) -> dict[str, np.ndarray]:
    """The full arrays under ``prefixes`` from every rank's shard arrays, in rank order (dim-0 shards)."""
    keys = sorted({k for r in records for k in r.arrays if k.startswith(prefixes)})
    merged: dict[str, np.ndarray] = {}
    for key in keys:
        parts = [r.arrays[key] for r in records if key in r.arrays]
        if key.startswith(prefixes[0]):
            merged[key] = np.concatenate(parts, axis=0)
        else:
            merged[key] = combine(parts)
    return merged


def renamed(arrays: dict[str, np.ndarray], source: tuple[str, str], target: tuple[str, str]) -> dict[str, np.ndarray]:
    """The arrays under ``source`` prefixes, keyed under ``target``'s: late gradients seen as step 0's."""
    out = {}
    for key, value in arrays.items():
        for old, new in zip(source, target):
            if key.startswith(old):
                out[new + key.removeprefix(old)] = value
    return out


def names(record: RunRecord) -> list[str]:
    """Every parameter with a step-0 gradient, whole or in blocks."""
    return sorted(k.split("/", 1)[1] for k in record.arrays if k.startswith((FULL_PREFIX, BLOCK_PREFIX)))


def each(record: RunRecord) -> Iterator[tuple[str, str, np.ndarray]]:
    """(name, prefix, array) of every step-0 gradient: whole (FULL_PREFIX) or in blocks (BLOCK_PREFIX)."""
    for name in names(record):
        found = full_or_blocks(record, name)
        if found is not None:
            yield name, *found


def totals(prefix: str, array: np.ndarray) -> list[float]:
    """[sum, sum of |x|, max |x|] of a gradient, in float64, from its whole values or its blocks' rows."""
    values = np.asarray(array, dtype=np.float64)
    if prefix == BLOCK_PREFIX:
        return [float(values[:, _SUM].sum()), float(values[:, _ABS_SUM].sum()), float(values[:, _MAX_ABS].max(initial=0.0))]
    magnitude = np.abs(values.reshape(-1))
    return [float(values.sum()), float(magnitude.sum()), float(magnitude.max(initial=0.0))]


def full_or_blocks(record: RunRecord, name: str) -> tuple[str, np.ndarray] | None:
    for prefix in (FULL_PREFIX, BLOCK_PREFIX):
        if prefix + name in record.arrays:
            return prefix, record.arrays[prefix + name]
    return None


def block_deviation(run: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per block: the largest change of its sum, |sum| or max |x|, over the tensor's max |x|."""
    scale = max(float(ref[:, _MAX_ABS].max()) if ref.size else 0.0, float(np.finfo(np.float32).tiny))
    diff = np.abs(run[:, _SUM:] - ref[:, _SUM:]).max(axis=1) / scale if ref.size else np.zeros(0)
    broken = np.isnan(run[:, _SUM:]).any(axis=1) != np.isnan(ref[:, _SUM:]).any(axis=1)
    return np.where(broken, np.inf, np.nan_to_num(diff, nan=0.0))


def tensor_deviation(run: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|run - ref| / max|ref| elementwise: the scale of the whole tensor, so near-zero entries do not explode."""
    scale = max(float(np.abs(ref).max()) if ref.size else 0.0, float(np.finfo(np.float32).tiny))
    diff = np.abs(run.astype(np.float64) - ref.astype(np.float64)) / scale
    return np.where(np.isnan(run) != np.isnan(ref), np.inf, np.nan_to_num(diff, nan=0.0))


def step0_deviation(run: RunRecord, reference: RunRecord, name: str) -> np.ndarray | None:
    """Per element (whole tensors) or per block (large ones) deviation; None when missing or reshaped."""
    found = full_or_blocks(reference, name)
    if found is None:
        return None
    prefix, ref = found
    got = run.arrays.get(prefix + name)
    if prefix == BLOCK_PREFIX:
        return block_deviation(got, ref) if got is not None and same_layout(got, ref) else None
    return tensor_deviation(got, ref).reshape(-1) if got is not None and got.shape == ref.shape else None


def block_bound_scale(ref: np.ndarray) -> np.ndarray:
    """Per block: how many times an element's rounding bound its block's sum may differ by (unit: max |x|).
    Independent errors grow like sqrt(sum x_i^2) (comparison/bounds.py's model), at most sqrt(max |x| x sum |x|);
    never below 1, a one-element block being that element."""
    scale = max(float(ref[:, _MAX_ABS].max()) if ref.size else 0.0, float(np.finfo(np.float32).tiny))
    return np.maximum(1.0, np.sqrt(np.abs(ref[:, _MAX_ABS] * ref[:, _ABS_SUM])) / scale)


def same_layout(run: np.ndarray, ref: np.ndarray) -> bool:
    return run.shape == ref.shape and np.array_equal(run[:, :_SUM], ref[:, :_SUM])


def block_label(rows: np.ndarray, i: int, shape: tuple[int, ...] | None = None) -> str:
    """'block 17 (elements 17408..18431)', with the index of its first element when the shape is known."""
    first = int(rows[i, _INDEX]) * BLOCK
    last = first + int(rows[i, _COUNT]) - 1
    where = f"block {int(rows[i, _INDEX])} (elements {first}..{last}"
    if shape:
        where += f", from {tuple(int(j) for j in np.unravel_index(first, shape))}"
    return where + ")"


def block_sums(rows: np.ndarray) -> np.ndarray:
    return rows[:, _SUM]
