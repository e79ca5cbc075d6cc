"""The two ways the lora scenario distributes the peft model (scenarios/lora/wrappers.py), in process at one gloo
rank: fully_shard directly and accelerate's prepare (DDP across CPU ranks; at one rank the model as it is), each
behind one interface: what it trains (whatever requires a gradient), its clip, its backward, and the whole state dict
its users save."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pytest_gpuregress.scenarios.lora import adapter, checks
from pytest_gpuregress.scenarios.lora.wrappers import Wrapped, build

from ..conftest import FAULTED_MODULE, tiny_lora_config

LEAKED = f"base_model.model.{FAULTED_MODULE}.base_layer.weight"


@pytest.fixture(autouse=True)
def accelerate_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """accelerate's process-wide state and the environment it reads, as they were before the test."""
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # what wrappers.accelerate sets for accelerate; undone after
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def peft_model(tiny: dict[str, Any], leak: bool = False) -> Any:
    """The tiny Llama with its adapter; ``leak``: one base weight left trainable, as a broken peft would."""
    model = adapter.wrap_with_lora(tiny["base"](), tiny["cfg"])
    adapter.load_adapter_tensors(model, tiny["trained"])
    if leak:
        model.get_parameter(LEAKED).requires_grad_(True)
    return model


def wrapped_by(wrapper: str, tiny: dict[str, Any], leak: bool = False) -> Wrapped:
    return build(peft_model(tiny, leak), tiny_lora_config(wrapper), "cpu", 1)


def one_backward(wrapped: Wrapped, tiny: dict[str, Any]) -> None:
    """The next-token loss of the fixed batch, through the wrapper's own backward."""
    import torch.nn.functional as F

    logits = wrapped.model(input_ids=tiny["batch"][:, :-1]).logits
    wrapped.backward(F.cross_entropy(logits.flatten(0, 1), tiny["batch"][:, 1:].flatten()))


def global_norm(params: list[Any]) -> float:
    from pytest_gpuregress.scenarios.lora.adapter_io import full_tensor

    return float(sum(full_tensor(p.grad).double().pow(2).sum() for p in params if p.grad is not None) ** 0.5)


def stepped(optimizer: Any) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


WRAPPERS = ["fsdp2", "accelerate"]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_each_wrapper_trains_whatever_requires_a_gradient(wrapper: str, tiny: dict[str, Any],
                                                          one_rank_group: None) -> None:
    """The optimizer steps the adapter, and a base weight peft left trainable too (as the HF Trainer would), so a
    leak moves the base; the torch optimizer is reachable under accelerate's wrapper."""
    import torch

    for leak in (False, True):
        wrapped = wrapped_by(wrapper, tiny, leak)
        named = dict(wrapped.peft_model.named_parameters())
        expected = {id(p) for n, p in named.items() if checks.is_adapter(n) or (leak and n == LEAKED)}
        assert stepped(wrapped.torch_optimizer) == expected
        assert isinstance(wrapped.torch_optimizer, torch.optim.AdamW)
    assert (wrapped.accelerator is None) == (wrapper == "fsdp2")
    assert (wrapped.optimizer is wrapped.torch_optimizer) == (wrapper == "fsdp2")


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_each_wrapper_clips_to_the_global_norm_it_returns(wrapper: str, tiny: dict[str, Any],
                                                          one_rank_group: None) -> None:
    """After the wrapper's backward the adapter has gradients; clip returns their norm before clipping and leaves
    them at the limit."""
    wrapped = wrapped_by(wrapper, tiny)
    one_backward(wrapped, tiny)
    adapters = [p for n, p in wrapped.peft_model.named_parameters() if checks.is_adapter(n)]
    norm = global_norm(adapters)
    assert norm > 1e-3
    assert wrapped.clip(1e-3) == pytest.approx(norm, rel=1e-5)
    assert global_norm(adapters) == pytest.approx(1e-3, rel=1e-4)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_each_wrapper_saves_whole_tensors(wrapper: str, tiny: dict[str, Any], one_rank_group: None) -> None:
    """The state dict its users save holds every parameter whole (no shard) with the values it was given."""
    import torch

    wrapped = wrapped_by(wrapper, tiny)
    state = wrapped.state_dict_for_save()
    key = f"base_model.model.{FAULTED_MODULE}.lora_B.default.weight"
    assert {n for n in state if checks.is_adapter(n)} == set(tiny["trained"])
    assert not any(hasattr(v, "full_tensor") for v in state.values())
    assert torch.equal(state[key], torch.from_numpy(tiny["trained"][key]))


def test_fully_shard_shards_the_peft_model_itself(tiny: dict[str, Any], one_rank_group: None) -> None:
    """Under fully_shard what training calls is the peft model, its parameters DTensors."""
    wrapped = wrapped_by("fsdp2", tiny)
    assert wrapped.model is wrapped.peft_model
    assert all(hasattr(p, "full_tensor") for p in wrapped.peft_model.parameters())


def test_an_unknown_wrapper_is_refused(tiny: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="known: fsdp2, accelerate"):
        build(peft_model(tiny), {**tiny_lora_config(), "wrapper": "deepspeed"}, "cpu", 1)
