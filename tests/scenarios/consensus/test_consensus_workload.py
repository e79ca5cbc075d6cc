"""The consensus scenario's single-device workload (scenarios/consensus/workload.py): the same bits on every run
whatever the process's generators hold, the tensors each part digests, and a one-ulp matmul seen in exactly the
digests of the products it touched."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from pytest_gpuregress.faults import install_counted
from pytest_gpuregress.scenarios.consensus import WORKLOAD
from pytest_gpuregress.scenarios.consensus.digest import Digests, entry_name, split_name
from pytest_gpuregress.scenarios.consensus.workload import (
    CAST_FORMATS,
    CAST_LITERALS,
    GEMM_DTYPES,
    GEMM_SHAPES,
    cast_grid,
    run_all,
)

STEPS = 2
CONFIG: dict[str, Any] = {**WORKLOAD, "steps": STEPS}
PARAMS = ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]  # Linear, GELU, LayerNorm, Linear
FORMATS = [name for name in CAST_FORMATS if hasattr(torch, name)]


def by_name(digests: Digests) -> dict[str, tuple[str, int]]:
    """name -> (kind, hash)."""
    return {name: (kind, h) for name, kind, h in zip(digests.names, digests.kinds, digests.hashes)}


@pytest.fixture(scope="module")
def clean() -> Digests:
    return run_all("cpu", CONFIG)


@pytest.mark.usefixtures("kept_generators")
def test_the_workload_is_the_same_bits_whatever_the_global_generators_hold(clean: Digests) -> None:
    """Every input is drawn from the workload's own seeded generators: reseeding the process's changes nothing."""
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    again = run_all("cpu", CONFIG)
    assert again.names == clean.names and again.hashes == clean.hashes
    assert np.array_equal(again.sums, clean.sums, equal_nan=True)  # the casts' NaN sums too


def test_each_part_digests_its_tensors_in_order(clean: Digests) -> None:
    """train: per step its loss, then each parameter's gradient and weight; gemm: every shape and dtype's matmul, the
    bmm and the reductions; cast: the grid to each format this torch has, and every fp8 code decoded."""
    train = [entry_name("train", tensor, step) for step in range(STEPS)
             for tensor in ["loss", *(f"grad {p}" for p in PARAMS), *(f"weight {p}" for p in PARAMS)]]
    assert clean.names[: len(train)] == train
    gemm = [n for n in clean.names if n.startswith("gemm|")]
    assert gemm[: len(GEMM_DTYPES) * len(GEMM_SHAPES)] == [entry_name("gemm", f"matmul {d} {m}x{k}x{n}")
                                                           for d in GEMM_DTYPES for m, k, n in GEMM_SHAPES]
    assert len(gemm) == 9 + 1 + 10
    kinds = by_name(clean)
    assert kinds[entry_name("gemm", "bmm float32 8x33x65x17")][0] == "float32[8, 33, 17]"
    grid = 2 * len(CAST_LITERALS) + 4096
    for name in FORMATS:
        assert kinds[entry_name("cast", f"float32 grid to {name}")][0] == f"{name}[{grid}]"
        if getattr(torch, name).itemsize == 1:
            assert kinds[entry_name("cast", f"decode every {name} code")][0] == "float32[256]"
    assert len(clean.names) == len(clean.hashes) == len(clean.sums) == len(clean.magnitudes)


def test_the_cast_grid_leads_with_the_literals_of_both_signs() -> None:
    """The values a cast must get right come first, then their negatives, then the seeded spread."""
    grid = cast_grid(torch.Generator().manual_seed(2))
    literals = torch.tensor(CAST_LITERALS)
    count = len(CAST_LITERALS)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        """Equal values and signs, NaN where NaN."""
        return bool(((a == b) & (a.signbit() == b.signbit()) | (a.isnan() & b.isnan())).all())

    assert grid.dtype == torch.float32 and grid.numel() == 2 * count + 4096
    assert same(grid[:count], literals) and same(grid[count : 2 * count], -literals)
    assert grid[2 * count :].abs().max() > 2.0**15 and grid[2 * count :].abs().min() < 2.0**-25  # the spread's range


def test_a_one_ulp_matmul_moves_exactly_the_products_it_touched(clean: Digests) -> None:
    """matmul_ulp after its first call: every later matmul and the bmm differ, by a sum a hair off; the first
    matmul, the reductions and the casts (no matmul in them) keep their bits."""
    on_device = SimpleNamespace(rank=0, cleanup_hooks=[])
    [firing] = install_counted(["matmul_ulp:after=1"], on_device)
    try:
        faulty = run_all("cpu", {**CONFIG, "parts": ["gemm", "cast"]})
    finally:
        for undo in reversed(on_device.cleanup_hooks):
            undo()
    products = [n for n in faulty.names if split_name(n)[2].startswith(("matmul ", "bmm "))]
    reference = by_name(clean)
    moved = {n for n, (_, h) in by_name(faulty).items() if reference[n][1] != h}
    assert len(products) == 10 and firing.count == len(products) - 1
    assert moved == set(products[1:])
    second = products[1]
    assert faulty.sums[faulty.names.index(second)] == pytest.approx(clean.sums[clean.names.index(second)], rel=1e-6)
