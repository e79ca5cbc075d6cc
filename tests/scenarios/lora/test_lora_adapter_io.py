"""The adapter's I/O on the rank (scenarios/lora/adapter_io.py), on the tiny Llama in process: whole tensors out of
FSDP2 shards, the save as users make it (save_pretrained, safetensors) read back under peft's keys, the reload into
a fresh base model, and the save fault point a fault acts at. The round trip's checks on these: test_lora_rank.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_gpuregress.scenarios.lora import adapter, checks
from pytest_gpuregress.scenarios.lora.adapter_io import (
    ADAPTER_FILE,
    full_tensor,
    gather_for_save,
    read_saved,
    reload,
    to_numpy,
    write_adapter,
)

from ..conftest import FAULTED_MODULE, injected


def trained_model(tiny: dict[str, Any]) -> Any:
    """A fresh tiny Llama with the fixture's adapter on it."""
    peft_model = adapter.wrap_with_lora(tiny["base"](), tiny["cfg"])
    adapter.load_adapter_tensors(peft_model, tiny["trained"])
    return peft_model


def saved(tiny: dict[str, Any], folder: Path) -> dict[str, np.ndarray]:
    """The fixture's adapter saved into ``folder`` from its model's whole state dict, and read back."""
    peft_model = trained_model(tiny)
    write_adapter(peft_model, peft_model.state_dict(), str(folder))
    return read_saved(str(folder))


def test_to_numpy_copies_and_reads_bf16_exactly() -> None:
    """bf16 goes through fp32 without rounding; the array is a copy the tensor does not share."""
    import torch

    values = torch.tensor([1.0, -0.0078125, 3.140625, 2.0**-20], dtype=torch.bfloat16)
    read = to_numpy(values)
    assert read.dtype == np.float32
    assert read.tolist() == [1.0, -0.0078125, 3.140625, 2.0**-20]
    plain = torch.arange(4.0)
    copy = to_numpy(plain)
    copy[0] = 9.0
    assert plain[0].item() == 0.0


def test_whole_tensors_come_out_of_fsdp2_shards(tiny: dict[str, Any], one_rank_group: None) -> None:
    """Under fully_shard the parameters are DTensors: full_tensor gathers them, gather_for_save gives every tensor
    whole on the CPU under its parameter name, values as before sharding; a plain tensor passes through as it is."""
    import torch

    from pytest_gpuregress.scenarios.shared.trainer import fully_sharded

    peft_model = trained_model(tiny)
    before = {name: p.detach().clone() for name, p in peft_model.named_parameters()}
    plain = next(iter(before.values()))
    assert full_tensor(plain) is plain
    fully_sharded(peft_model, torch.device("cpu"), None, 1)
    sharded = dict(peft_model.named_parameters())
    assert all(hasattr(p, "full_tensor") for p in sharded.values())
    lora_b = f"base_model.model.{FAULTED_MODULE}.lora_B.default.weight"
    gathered = full_tensor(sharded[lora_b])
    assert not hasattr(gathered, "full_tensor") and torch.equal(gathered, before[lora_b])

    state = gather_for_save(peft_model)
    assert set(state) == set(before)
    assert all(not hasattr(v, "full_tensor") and v.device.type == "cpu" for v in state.values())
    assert all(torch.equal(state[name], before[name]) for name in before)


def test_the_saved_adapter_holds_every_trained_tensor_under_peft_keys(tiny: dict[str, Any], tmp_path: Path) -> None:
    """save_pretrained writes the adapter only, one key per trained tensor (no adapter name), bit for bit."""
    found = saved(tiny, tmp_path)
    assert (tmp_path / ADAPTER_FILE).is_file()
    assert set(found) == {checks.canonical(name) for name in tiny["trained"]}
    assert all(np.array_equal(found[checks.canonical(name)], values) for name, values in tiny["trained"].items())


def test_the_reload_puts_the_saved_adapter_on_a_fresh_base_frozen(tiny: dict[str, Any], tmp_path: Path) -> None:
    """PeftModel.from_pretrained on a newly built base: the trained adapter, not trainable, and the base's weights."""
    import torch

    saved(tiny, tmp_path)
    reloaded = reload(tiny["base"](), str(tmp_path))
    params = dict(reloaded.named_parameters())
    assert {n for n in params if checks.is_adapter(n)} == set(tiny["trained"])
    assert all(np.array_equal(to_numpy(params[name]), values) for name, values in tiny["trained"].items())
    assert not any(p.requires_grad for p in params.values())
    fresh = dict(tiny["base"]().named_parameters())
    base_q = params[f"base_model.model.{FAULTED_MODULE}.base_layer.weight"]
    assert torch.equal(base_q, fresh[f"{FAULTED_MODULE}.weight"])


def test_a_folder_without_the_adapter_file_reads_as_empty(tmp_path: Path) -> None:
    assert read_saved(str(tmp_path)) == {}


def test_a_fault_at_the_save_changes_the_file_not_the_model(tiny: dict[str, Any], tmp_path: Path) -> None:
    """The zero_lora_b fault acts at write_adapter: the file holds that one lora_B as zeros, every other tensor
    as trained."""
    with injected("lora:mode=zero_lora_b") as fault:
        found = saved(tiny, tmp_path)
    assert fault.count == 1
    zeroed = f"base_model.model.{FAULTED_MODULE}.lora_B.weight"
    assert not np.any(found[zeroed]) and np.any(tiny["trained"][zeroed.replace(".weight", ".default.weight")])
    rest = {checks.canonical(n): v for n, v in tiny["trained"].items() if checks.canonical(n) != zeroed}
    assert all(np.array_equal(found[key], values) for key, values in rest.items())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_saved_file_keeps_the_dtype_it_was_given(tiny: dict[str, Any], tmp_path: Path, dtype: str) -> None:
    """A bf16 adapter is saved as bf16 and read back through fp32 exactly (the check compares it with the trained)."""
    import torch
    from safetensors import safe_open

    peft_model = trained_model(tiny)
    state = {name: value.to(getattr(torch, dtype)) for name, value in peft_model.state_dict().items()}
    write_adapter(peft_model, state, str(tmp_path))
    found = read_saved(str(tmp_path))
    with safe_open(str(tmp_path / ADAPTER_FILE), "pt") as handle:
        assert {handle.get_slice(key).get_dtype() for key in handle.keys()} == {"F32" if dtype == "float32" else "BF16"}
    expected = {checks.canonical(n): to_numpy(torch.from_numpy(v).to(getattr(torch, dtype)))
                for n, v in tiny["trained"].items()}
    assert all(np.array_equal(found[key], values) for key, values in expected.items())
