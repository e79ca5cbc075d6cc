"""training/state_digests.py: the digest of each piece of training state, so a resume that loses one piece is
named by that piece, and a key another torch adds on load is not taken for a lost one."""

from __future__ import annotations

from typing import Any

import torch

from pytest_gpuregress.training import state_digests


class State:
    """A trainer as the digests read it: a Linear under AdamW and a LambdaLR."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0 / (step + 1))
        self.names = [n for n, _ in self.model.named_parameters()]

    @property
    def params(self) -> list[Any]:
        return list(self.model.parameters())

    def step(self) -> None:
        self.model(torch.ones(4, 3)).square().sum().backward()
        self.optimizer.step()
        self.scheduler.step()


def _digests(state: State) -> dict[str, dict[str, str]]:
    return state_digests.boundary(state, data_position=8, device_kind="cpu", rank=0)


def test_every_piece_a_resume_restores_has_a_digest_and_equal_states_digest_equal() -> None:
    a, b = State(), State()
    a.step()
    b.step()
    digests = _digests(a)
    assert {"model", "optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.step", "optimizer.param_groups",
            "lr_scheduler", "data.position"} <= set(digests)
    assert digests["optimizer.step"] == {"weight": "1.0", "bias": "1.0"}  # shown as a number, not a hash
    assert digests == _digests(b)


def test_one_lost_moment_element_differs_in_that_piece_and_parameter_only() -> None:
    a, b = State(), State()
    a.step()
    b.step()
    with torch.no_grad():
        b.optimizer.state[b.model.bias]["exp_avg_sq"][-1] = 0.0
    left, right = _digests(a), _digests(b)
    differing = {(piece, name) for piece in left for name in left[piece] if left[piece][name] != right[piece][name]}
    assert differing == {("optimizer.exp_avg_sq", "bias")}


def test_a_key_another_torch_adds_on_load_is_not_a_lost_piece() -> None:
    state = State()
    saved_groups = state_digests.param_groups(state)
    saved_scheduler = state_digests.scheduler_state(state)
    before = _digests(state)
    state.optimizer.param_groups[0]["added_by_a_newer_torch"] = True
    after = _digests(state)
    assert after["optimizer.param_groups"] != before["optimizer.param_groups"]
    state_digests.as_saved(before, state, saved_groups, saved_scheduler)
    state_digests.as_saved(after, state, saved_groups, saved_scheduler)
    assert after["optimizer.param_groups"] == before["optimizer.param_groups"]
