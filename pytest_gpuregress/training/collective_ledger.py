"""Rank side of the collective invariants (evidence/collective_invariants.py): a few numbers per collective call.

Every ``torch.distributed`` collective of the step passes through a wrapper that reads its input and output
(float64 sums, a bit hash and a position-weighted sum, which sees two swapped elements), waiting for an
asynchronous call first. After the last step rank 0 checks the gathered rows; the record keeps the verdict.
Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..evidence import collective_invariants as invariants
from ..evidence.op_trace_modes import unwatched
from ..evidence.tensor_digest import digest
from ..fault_points import in_plugin_own_collective, plugin_own_collectives

# torch.distributed's collectives by name: (the op family, the keyword of its output, that of its input). FSDP2 calls
# all_gather_single and reduce_scatter_single on torch 2.13, all_gather_into_tensor and reduce_scatter_tensor before.
COLLECTIVES: dict[str, tuple[str, str, str | None]] = {
    "all_reduce": ("all_reduce", "tensor", None),
    "reduce_scatter_single": ("reduce_scatter", "output", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "output", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "output", "input"),
    "reduce_scatter": ("reduce_scatter", "output", "input_list"),
    "all_gather_single": ("all_gather", "output_tensor", "input_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor", "input_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor", "input_tensor"),
    "all_gather": ("all_gather", "tensor_list", "tensor"),
    "broadcast": ("broadcast", "tensor", None),
    "all_to_all_single": ("all_to_all", "output", "input"),
    "all_to_all": ("all_to_all", "output_tensor_list", "input_tensor_list"),
}
_UNIT_ROUNDOFF = {"torch.float64": 2.0**-53, "torch.float32": 2.0**-24, "torch.bfloat16": 2.0**-8,
                  "torch.float16": 2.0**-11}


def _tensors(value: Any) -> list[Any]:
    if value is None:
        return []
    return [t for t in value if t is not None] if isinstance(value, (list, tuple)) else [value]


def _float64(tensor: Any) -> Any:
    """``tensor`` flat, in float64 (a complex one as its real and imaginary parts)."""
    import torch

    flat = tensor.detach().reshape(-1)
    return (torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat).to(torch.float64)


def _sums(tensors: list[Any], offset: int = 0) -> tuple[float, float, float, int, float]:
    """Float64 sum, sum of |x| and of x^2, the chained digest hashes (tensor_digest.py) and the position-weighted
    sum from ``offset`` (``weighted_sum``) over ``tensors``: one float64 copy of each serves both sums."""
    import torch

    total = absolute = squares = weighted = 0.0
    hashed = 0
    for tensor in tensors:
        with torch.no_grad():
            found = digest(tensor)
            total, absolute = total + found[0], absolute + found[1]
            wide = _float64(tensor)
            squares += float((wide * wide).sum())  # not torch.dot: the kernel inventory of the references has these ops
            weighted += _weighted(wide, offset)
        offset += tensor.numel()
        hashed = (hashed * 1000003 + found[3]) & ((1 << 64) - 1)
    return total, absolute, squares, hashed - (1 << 64) if hashed >= 1 << 63 else hashed, weighted


# Position weights: w(j) = 0.5 + ((j * 40503) mod P) / P, periodic with the prime P. A tensor's weighted sum adds
# its elements by column of a [rows, P] view (its first element at the column of its global offset), then dots the
# columns' sums with the weights: one pass, no weight vector of the tensor's size. Two swapped elements go unseen
# only where their positions are a multiple of P apart.
WEIGHT_PERIOD = 65521
_WEIGHTS: dict[str, Any] = {}


def _weights(device: Any) -> Any:
    import torch

    key = str(device)
    if key not in _WEIGHTS:
        positions = torch.arange(WEIGHT_PERIOD, dtype=torch.int64, device=device)
        _WEIGHTS[key] = 0.5 + ((positions * 40503) % WEIGHT_PERIOD).to(torch.float64) / WEIGHT_PERIOD
    return _WEIGHTS[key]


def _weighted(flat: Any, offset: int) -> float:
    """Sum of w(offset + j) x_j over the flat float64 tensor ``flat``."""
    import torch

    lead = offset % WEIGHT_PERIOD
    padded = torch.nn.functional.pad(flat, (lead, (-(lead + flat.numel())) % WEIGHT_PERIOD))
    return float(padded.view(-1, WEIGHT_PERIOD).sum(0) @ _weights(flat.device))


def weighted_sum(tensors: list[Any], offset: int = 0) -> float:
    """Sum of w(offset + j) x_j over ``tensors`` as one flat sequence from global position ``offset`` (an
    all-gather's input sits at its rank's place in the output; a reduce-scatter's output in the input)."""
    import torch

    total = 0.0
    for tensor in tensors:
        with torch.no_grad():
            total += _weighted(_float64(tensor), offset)
        offset += tensor.numel()
    return total


def _offsets(family: str, group_rank: int, inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """(the input's, the output's) global position in the flat sequence the weights run over."""
    if family == "all_gather":
        return group_rank * sum(t.numel() for t in inputs), 0
    if family == "reduce_scatter":
        return 0, group_rank * sum(t.numel() for t in outputs)
    return 0, 0


class Ledger:
    """The rows of one rank (``invariants.COLUMNS``), and the string tables they index."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.rows: list[list[float]] = []
        self.ops: list[str] = sorted({family for family, _, _ in COLLECTIVES.values()})
        self.groups: list[str] = []
        self.reductions: list[str] = ["none", "sum", "avg", "max", "min", "product", "premul_sum", "other"]
        self._seq: dict[int, int] = {}
        self._inside = False

    def _group(self, group: Any) -> tuple[int, int]:
        import torch.distributed as dist

        ranks = ",".join(str(r) for r in dist.get_process_group_ranks(group or dist.group.WORLD))
        if ranks not in self.groups:
            self.groups.append(ranks)
        index = self.groups.index(ranks)
        self._seq[index] = self._seq.get(index, 0) + 1
        return index, self._seq[index]

    def _reduction(self, op: Any, family: str) -> tuple[int, float]:
        """The reduction's index in the table, and PREMUL_SUM's factor (1 for the others)."""
        if family not in ("all_reduce", "reduce_scatter"):
            return 0, 1.0
        text = str(getattr(op, "op", op)).lower() if op is not None else "sum"
        index = next((i for i, name in enumerate(self.reductions) if name != "none" and name in text),
                     len(self.reductions) - 1)
        factor = 1.0
        if self.reductions[index] == "premul_sum":
            try:
                factor = float(op.__getstate__()[1])  # a ReduceOp made by _make_nccl_premul_sum(factor)
            except (AttributeError, IndexError, TypeError, ValueError):
                index = len(self.reductions) - 1  # its factor unknown: no invariant to hold it to
        return index, factor

    def wrap(self, dist: Any, name: str) -> Callable[[], None]:
        """Wrap ``dist.<name>``; return the undo."""
        original = getattr(dist, name)
        family, out_key, in_key = COLLECTIVES[name]
        signature = inspect.signature(original)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._inside or in_plugin_own_collective():
                return original(*args, **kwargs)
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                return original(*args, **kwargs)
            self._inside = True
            try:
                outputs = _tensors(bound.get(out_key))
                inputs = _tensors(bound.get(in_key)) if in_key else outputs
                group_rank = int(dist.get_rank(bound.get("group") or dist.group.WORLD))
                in_at, out_at = _offsets(family, group_rank, inputs, outputs)
                with unwatched():  # the ledger's reads are not ops of the step: the op trace must not see them
                    before = _sums(inputs, in_at)  # before the call: an in-place collective overwrites its input
                work = original(*args, **kwargs)
                if work is not None and hasattr(work, "wait"):
                    work.wait()
                with unwatched():
                    after = _sums(outputs, out_at)
                group, seq = self._group(bound.get("group"))
                dtype = str(outputs[0].dtype) if outputs else "torch.float32"
                reduction, factor = self._reduction(bound.get("op"), family)
                self.rows.append([float(self.ctx.current_step if self.ctx.current_step is not None else -1), group,
                                  seq, self.ops.index(family), reduction, factor, _UNIT_ROUNDOFF.get(dtype, 2.0**-24),
                                  float(sum(t.numel() for t in outputs)), *before[:3], *after[:3],
                                  float(np.int64(after[3]).view(np.float64)), before[4], after[4]])
                return work
            finally:
                self._inside = False

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(dist, name, wrapper)
        return lambda: setattr(dist, name, original)

    def results(self) -> dict[str, Any]:
        """Every rank's rows gathered and judged: the same summary on every rank. Collective, after the last step."""
        import torch
        import torch.distributed as dist

        world = dist.get_world_size()
        mine = torch.tensor(np.array(self.rows, dtype=np.float64).reshape(-1, len(invariants.COLUMNS)))
        gathered = _gather_rows(mine, world)
        tables = self._gather_groups(world)  # each rank met the groups in its own order: mapped to one table
        groups: list[str] = []
        rows: dict[int, np.ndarray] = {}
        for rank, table in enumerate(gathered):
            found = table.numpy().copy()
            for i, row in enumerate(found):
                name = tables[rank][int(row[1])]
                if name not in groups:
                    groups.append(name)
                found[i, 1] = groups.index(name)
            rows[rank] = found
        calls, violations = invariants.check(rows, self.ops, groups, self.reductions)
        return {invariants.RESULT_KEY: invariants.summary(calls, violations, sorted(set(self.ops)))}

    def _gather_groups(self, world: int) -> list[list[str]]:
        """Every rank's table of groups, each a string of global ranks, gathered as uint8 tensors."""
        import torch

        encoded = ";".join(self.groups).encode()
        mine = torch.frombuffer(bytearray(encoded), dtype=torch.uint8) if encoded else torch.zeros(0, dtype=torch.uint8)
        return [bytes(g.tolist()).decode().split(";") if len(g) else [] for g in _gather_rows(mine, world)]


def _gather_rows(values: Any, world: int) -> list[Any]:
    """Every rank's ``values`` (a CPU tensor, first dimension differing between ranks), in rank order, padded for
    the all-gather and cut back. Collective (the plugin's own)."""
    import torch
    import torch.distributed as dist

    with plugin_own_collectives():
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(values)], dtype=torch.int64))
        padded = torch.zeros(max(int(s) for s in sizes), *values.shape[1:], dtype=values.dtype)
        padded[:len(values)] = values
        gathered = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded)
    return [g[:int(s)] for g, s in zip(gathered, sizes)]


@contextmanager
def watching(ctx: Any) -> Iterator[Ledger]:
    """Keep the ledger of every collective the body makes; the wrappers are removed after it."""
    import torch.distributed as dist

    ledger = Ledger(ctx)
    undo = [ledger.wrap(dist, name) for name in COLLECTIVES if hasattr(dist, name)]
    try:
        yield ledger
    finally:
        for step in reversed(undo):
            step()
