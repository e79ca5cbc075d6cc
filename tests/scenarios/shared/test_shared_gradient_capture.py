"""One step's gradients in step 0's array form (scenarios/shared/gradient_capture.py): only the asked step, copies
that clipping cannot scale afterwards, zeros for an unused parameter, rank 0's whole tensor of a replicated gradient
and each rank's shard of an FSDP2 one, whole or in blocks by size."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from pytest_gpuregress.evidence import step0
from pytest_gpuregress.scenarios.shared.gradient_capture import capture
from pytest_gpuregress.training.fsdp2 import shard

NAMES = ["w", "unused"]


def ctx(rank: int = 0, world_size: int = 1, **config: Any) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, world_size=world_size, config=config)


def params(grad: torch.Tensor | None) -> list[torch.Tensor]:
    """A 3x4 parameter whose gradient is ``grad``, and one the loss never used (no gradient)."""
    used, unused = torch.zeros(3, 4, requires_grad=True), torch.zeros(5, requires_grad=True)
    used.grad = grad
    return [used, unused]


def test_only_the_asked_step_is_kept_as_copies_clipping_cannot_touch() -> None:
    """The hook ignores other steps; the kept arrays are copies (clipping scales the live gradient next), and an
    unused parameter's gradient is zero, as AdamW sees it."""
    grad = torch.arange(12.0).reshape(3, 4)
    tensors = params(grad)
    keep, arrays = capture(NAMES, tensors, ctx(), 2, step0.STEP0)
    keep(0)
    keep(1)
    assert arrays == {}
    keep(2)
    grad.mul_(0.5)  # clip_grad_norm_ scales in place
    assert sorted(arrays) == [step0.FULL_PREFIX + "unused", step0.FULL_PREFIX + "w"]
    assert np.array_equal(arrays[step0.FULL_PREFIX + "w"], np.arange(12.0, dtype=np.float32).reshape(3, 4))
    assert np.array_equal(arrays[step0.FULL_PREFIX + "unused"], np.zeros(5, dtype=np.float32))


def test_a_replicated_gradient_is_rank_0s_alone() -> None:
    """DDP: every rank holds the same reduced gradient; only rank 0 keeps it."""
    keep, arrays = capture(NAMES, params(torch.ones(3, 4)), ctx(rank=1, world_size=2), 0, step0.STEP0)
    keep(0)
    assert arrays == {}


def test_a_large_gradient_is_kept_in_blocks_under_the_second_prefix() -> None:
    """Above the run's whole-tensor threshold: rows of (block, count, sum, sum |x|, max |x|), in float64, under the
    blocks prefix (here the late gradients')."""
    grad = torch.linspace(-1.0, 2.0, 12).reshape(3, 4)
    keep, arrays = capture(NAMES[:1], params(grad)[:1], ctx(step0_full_max_elements=8), 0, step0.LATE)
    keep(0)
    [(key, rows)] = arrays.items()
    assert key == step0.LATE[1] + "w"
    assert rows.shape == (1, 5) and rows[0, 1] == 12
    assert rows[0, 2] == pytest.approx(float(grad.double().sum())) and rows[0, 4] == pytest.approx(2.0)


def test_an_fsdp2_gradient_is_this_ranks_shard(one_rank_group: None) -> None:
    """A DTensor parameter under fully_shard: this rank's local shard of its gradient (at one rank, all of it)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    shard([("", model)])
    model(torch.ones(2, 4)).pow(2).sum().backward()
    names = [name for name, _ in model.named_parameters()]
    keep, arrays = capture(names, list(model.parameters()), ctx(), 0, step0.STEP0)
    keep(0)
    for name, param in model.named_parameters():
        assert np.array_equal(arrays[step0.FULL_PREFIX + name], param.grad.to_local().numpy()), name
