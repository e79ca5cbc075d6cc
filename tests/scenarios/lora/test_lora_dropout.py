"""The LoRA dropout check (scenarios/lora/dropout_check.py): peft's lora_dropout off in eval, seeded, and applied,
on a real tiny Llama in process; each emulated dropout bug caught by name, and the clean stack passing."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pytest_gpuregress.findings import CheckFinding
from pytest_gpuregress.scenarios.lora.dropout_check import check_dropout
from pytest_gpuregress.triage.naming import rule_for

from ..conftest import injected


def _checked(tiny: dict[str, Any]) -> list[str]:
    return [f["message"] for f in check_dropout(tiny["base"], tiny["trained"], tiny["cfg"], tiny["batch"])]


def test_peft_dropout_on_this_stack_passes(tiny: dict[str, Any]) -> None:
    assert _checked(tiny) == []


@pytest.mark.parametrize("mode, expected", [
    ("dropout_in_eval", "in eval mode the adapter with lora_dropout=0.1 gives other logits than without dropout"),
    ("dropout_unseeded", "the masks do not follow torch's RNG"),
    ("dropout_shared", "the adapter's dropout reaches the input the base path shares"),
])
def test_a_dropout_bug_is_caught_by_name(tiny: dict[str, Any], mode: str, expected: str) -> None:
    with injected(f"lora:mode={mode}") as installed:
        found = _checked(tiny)
    assert installed.count > 0
    assert any(expected in message for message in found), found
    assert {rule_for(CheckFinding("dropout", message)).id for message in found} == {"lora-dropout"}


def test_a_dropout_never_applied_is_caught(tiny: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.nn.Dropout, "forward", lambda self, x: x)
    assert any(re.search(r"in train mode lora_dropout=\S+ changes nothing: ", m) and m.endswith("never applied")
               for m in _checked(tiny))


@pytest.mark.parametrize("broken, expected", [
    (lambda self, x: torch_dropout(x, self.p, self.training, rescale=False), "the inverted-dropout rescale is wrong"),
    (lambda self, x: torch_dropout(x, 2 * self.p, self.training, rescale=True), "of the inputs dropped with lora_dropout=0.1"),
])
def test_a_dropout_with_the_wrong_rescale_or_share_is_caught(tiny: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                              broken: Any, expected: str) -> None:
    import torch

    monkeypatch.setattr(torch.nn.Dropout, "forward", broken)
    assert any(expected in m for m in _checked(tiny)), _checked(tiny)


def torch_dropout(x: Any, p: float, training: bool, rescale: bool) -> Any:
    import torch

    if not training:
        return x
    keep = (torch.rand(x.shape, device=x.device) >= p).to(x.dtype)
    return x * keep / (1 - p) if rescale else x * keep


def test_the_check_leaves_the_ranks_random_state_as_it_found_it(tiny: dict[str, Any]) -> None:
    import torch

    torch.manual_seed(7)
    before = torch.get_rng_state()
    _checked(tiny)
    assert torch.equal(torch.get_rng_state(), before)
