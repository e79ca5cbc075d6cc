"""The ``cast:mode=truncate_bf16`` fault (faults/casts.py): fp32 and fp64 -> bf16 conversions round toward zero
instead of to nearest even, every other conversion stays exact, only the ranks it names, and only while installed."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from pytest_gpuregress.faults.casts import WRAPPED, truncated_bf16

from .conftest import Install, uninstall

ULP = 2.0**-7  # bf16's spacing in [1, 2)
# 0.75 ulp above 1 (nearest even: up, toward zero: down), the same below -1, an exact bf16, and 0.25 ulp (down either way)
VALUES = [1 + 0.75 * ULP, -(1 + 0.75 * ULP), 1.5, 1 + 0.25 * ULP]
NEAREST = [1 + ULP, -(1 + ULP), 1.5, 1.0]
TOWARD_ZERO = [1.0, -1.0, 1.5, 1.0]
SPEC = "cast:mode=truncate_bf16"


def as_list(tensor: torch.Tensor) -> list[float]:
    return tensor.float().tolist()


def toward_zero_oracle(values: np.ndarray) -> np.ndarray:
    """bf16 toward zero from ml_dtypes' nearest-even bf16: where that rounded away from zero, one bf16 step back
    toward zero (a finite non-zero bf16's magnitude is monotone in its low 15 bits)."""
    nearest = values.astype(ml_dtypes.bfloat16)
    away = np.abs(nearest.astype(np.float64)) > np.abs(values.astype(np.float64))
    bits = nearest.view(np.uint16).copy()
    bits[away] -= 1
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


def test_truncated_bf16_rounds_toward_zero_as_the_ml_dtypes_oracle_says() -> None:
    """The fault's conversion: every fp32 to the bf16 next to it on zero's side, never past it."""
    values = np.random.default_rng(0).normal(0, 3, 4096).astype(np.float32)
    cut = truncated_bf16(torch.from_numpy(values))
    assert cut.dtype == torch.bfloat16
    assert np.array_equal(cut.float().numpy(), toward_zero_oracle(values))
    assert (cut.float().abs().numpy() <= np.abs(values)).all()
    assert as_list(truncated_bf16(torch.tensor(VALUES))) == TOWARD_ZERO


def test_installed_every_fp32_and_fp64_to_bf16_cast_rounds_toward_zero_and_counts(install_faults: Install) -> None:
    """All the spellings of the cast FSDP2's mixed precision uses are cut; each conversion that changed counts once."""
    x = torch.tensor(VALUES)
    assert as_list(x.to(torch.bfloat16)) == NEAREST  # the stack's own rounding before the fault
    (firing,), _ = install_faults(SPEC)
    casts = [x.to(torch.bfloat16), x.bfloat16(), x.to(dtype=torch.bfloat16), x.to("cpu", torch.bfloat16),
             x.double().to(torch.bfloat16)]
    assert [as_list(c) for c in casts] == [TOWARD_ZERO] * 5
    assert firing.spec == SPEC and firing.count == 5
    exact = torch.tensor([1.5, -2.0, 0.0]).to(torch.bfloat16)  # nothing to round: no firing
    assert as_list(exact) == [1.5, -2.0, 0.0] and firing.count == 5


def test_installed_other_conversions_are_left_alone(install_faults: Install) -> None:
    """fp16, fp64, bf16 -> fp32 and bf16 -> bf16 give what the stack gives without the fault, and never fire."""
    x = torch.tensor(VALUES)
    want = {dtype: x.to(dtype) for dtype in (torch.float16, torch.float64, torch.int32)}
    bf16 = torch.tensor(NEAREST, dtype=torch.bfloat16)
    (firing,), _ = install_faults(SPEC)
    for dtype, expected in want.items():
        assert torch.equal(x.to(dtype), expected), dtype
    assert x.half().tolist() == want[torch.float16].tolist()
    assert bf16.to(torch.bfloat16) is bf16 and as_list(bf16.to(torch.float32)) == NEAREST
    assert firing.count == 0


def test_only_the_ranks_it_names_and_only_while_installed(install_faults: Install) -> None:
    """A spec for rank 1 installs nothing on rank 0; uninstalled, Tensor.to and Tensor.bfloat16 are torch's own."""
    originals = {name: getattr(torch.Tensor, name) for name in WRAPPED}
    x = torch.tensor(VALUES)
    firings, _ = install_faults(SPEC + ",rank=1", rank=0)
    assert firings == [] and as_list(x.to(torch.bfloat16)) == NEAREST
    firings, ctx = install_faults(SPEC + ",rank=1", rank=1)
    assert as_list(x.to(torch.bfloat16)) == TOWARD_ZERO and firings[0].count == 1
    uninstall(ctx)
    assert {name: getattr(torch.Tensor, name) for name in WRAPPED} == originals
    assert as_list(x.to(torch.bfloat16)) == NEAREST and as_list(x.bfloat16()) == NEAREST and firings[0].count == 1


@pytest.mark.parametrize("mode", ["truncate_fp16", "round"])
def test_a_mode_the_kind_lacks_is_refused_before_install(mode: str, install_faults: Install) -> None:
    """The spec is validated against the kind's schema: a mode the installer does not do patches nothing."""
    from pytest_gpuregress.errors import BadFaultSpec

    with pytest.raises(BadFaultSpec, match="mode="):
        install_faults(f"cast:mode={mode}")
    assert as_list(torch.tensor(VALUES).to(torch.bfloat16)) == NEAREST
