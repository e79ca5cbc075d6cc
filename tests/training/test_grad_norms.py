"""training/grad_norms.py: each rank's share of a squared gradient norm sums to the global one."""

from __future__ import annotations

import torch

from pytest_gpuregress.training.grad_norms import local_part, squared_norms


def test_a_replicated_gradient_counts_once_over_the_ranks_and_a_missing_one_as_zero() -> None:
    with_grad, without = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))
    with_grad.grad = torch.full((4,), 3.0)
    shares = squared_norms([with_grad, without], world_size=2, device="cpu")
    assert [float(s) for s in shares] == [18.0, 0.0]  # 4 * 9, halved on each of 2 ranks
    assert all(s.dtype == torch.float64 for s in shares)
    assert local_part(with_grad.grad, 2) == (with_grad.grad, False)
