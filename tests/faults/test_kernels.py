"""Kernel and throughput faults (faults/kernels.py): attention forced onto another SDPA backend, silu computed on the
host under the emulated accelerator's tag, a sleeping optimizer step; each counts its calls and is gone once undone."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pytest_gpuregress.faults.kernels import HOST_OPS, SDPA_BACKENDS
from pytest_gpuregress.training import kernels as training_kernels

from .conftest import Install, uninstall


@pytest.fixture
def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))  # type: ignore[return-value]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # looked up at call time, as a model does


def test_sdpa_backend_math_gives_the_math_kernels_output_instead_of_the_default(
        install_faults: Install, qkv: tuple[torch.Tensor, ...]) -> None:
    """On a CPU the default is the flash kernel; forced to math, each call gives math's bits and counts once."""
    original = F.scaled_dot_product_attention
    default = attention(*qkv)
    with sdpa_kernel(SDPBackend.MATH):
        math = attention(*qkv)
    assert not torch.equal(default, math)  # the two kernels differ in the last bits: the change is visible
    (firing,), ctx = install_faults("sdpa_backend:backend=math")
    assert torch.equal(attention(*qkv), math) and torch.equal(attention(*qkv), math)
    assert firing.count == 2
    uninstall(ctx)
    assert F.scaled_dot_product_attention is original and torch.equal(attention(*qkv), default)


def test_sdpa_backend_that_the_device_lacks_fails_the_call(install_faults: Install, qkv: tuple[torch.Tensor, ...]) -> None:
    """``efficient`` has no CPU kernel: the forced call raises, as a build missing the fused kernel would; not on rank 1."""
    assert set(SDPA_BACKENDS) == {"math", "flash", "efficient", "cudnn"}
    firings, _ = install_faults("sdpa_backend:backend=efficient,rank=1", rank=0)
    assert firings == [] and torch.equal(attention(*qkv), attention(*qkv))
    (firing,), _ = install_faults("sdpa_backend:backend=efficient")
    with pytest.raises(RuntimeError, match="No viable backend"):
        attention(*qkv)
    assert firing.count == 1


def test_host_op_runs_silu_on_the_host_with_the_same_values(monkeypatch: pytest.MonkeyPatch, install_faults: Install) -> None:
    """F.silu moves to the host (inside host_fallback, under the emulated accelerator's tag on a CPU build), gives
    silu's exact values, in place too, and counts each call; undone, silu and the tag are as before."""
    real = F.silu
    on_host: list[bool] = []

    def probe(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:  # what the fault wraps: the silu installed
        on_host.append(training_kernels._host_region.active())
        return real(x, inplace=inplace)

    monkeypatch.setattr(F, "silu", probe)
    x = torch.linspace(-4, 4, 33)
    want = real(x)
    assert HOST_OPS == ("silu",) and training_kernels.emulated_accelerator() is None
    (firing,), ctx = install_faults("host_op")
    assert training_kernels.emulated_accelerator() == "cuda (emulated by a device tag)"
    assert torch.equal(F.silu(x), want)
    y = x.clone()
    assert F.silu(y, inplace=True) is y and torch.equal(y, want)  # an in-place call still changes its input
    assert firing.count == 2 and on_host == [True, True]
    assert not training_kernels._host_region.active()
    uninstall(ctx)
    assert F.silu is probe and training_kernels.emulated_accelerator() is None


def test_slow_step_sleeps_in_every_optimizer_step_until_removed(install_faults: Install) -> None:
    """Each optimizer.step() sleeps the spec's seconds and counts; the step's arithmetic is unchanged; undone, no sleep."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    weight.grad = torch.full((3,), 2.0)
    (firing,), ctx = install_faults("slow_step:seconds=0.15")
    started = time.monotonic()
    optimizer.step()
    assert time.monotonic() - started >= 0.15 and firing.count == 1
    assert weight.detach().tolist() == [0.0, 0.0, 0.0]
    uninstall(ctx)
    started = time.monotonic()
    optimizer.step()
    assert time.monotonic() - started < 0.15 and firing.count == 1
    assert weight.detach().tolist() == [-1.0, -1.0, -1.0]
