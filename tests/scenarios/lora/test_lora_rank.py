"""The lora scenario's rank entry (scenarios/lora/rank.py) in process at one gloo rank: a clean run records the
adapter's metrics and passes every LoRA check; a base weight peft left trainable is caught in a run; and the adapter
round trip (save_pretrained, the file, from_pretrained, the logits) catches a save that zeroes a tensor, loses one,
keeps one rank's slice or fails, and a trained model whose forward a library replaced, each named."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_gpuregress.findings import CheckFinding
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.lora import adapter, checks, wrappers
from pytest_gpuregress.scenarios.lora.adapter_io import gather_for_save, to_numpy
from pytest_gpuregress.scenarios.lora.rank import _roundtrip, run
from pytest_gpuregress.triage.naming import rule_for

from ...conftest import gloo_world_of_one
from ..conftest import FAULTED_MODULE, injected, intercepting, rank_context, tiny_lora_config

ADAPTER_TENSORS = 2 * 7 * 2  # lora_A and lora_B of seven projections in each of the tiny Llama's two layers
Q_A = f"base_model.model.{FAULTED_MODULE}.lora_A.default.weight"


def named(findings: list[checks.Finding]) -> set[tuple[str, str]]:
    """(component, rule id) that triage names each finding by."""
    return {(rule.component, rule.id) for rule in (rule_for(CheckFinding.of(f)) for f in findings)}


# --- a whole run -------------------------------------------------------------------------------------


def test_a_clean_run_records_the_adapter_and_passes_every_lora_check(clean_lora_run: RunRecord) -> None:
    """Every check ran and found nothing; the record keeps the adapter's tensors only: their step-0 gradients,
    digests and gradient norms, a loss per step, and what the merge check measured inside its bound."""
    record = clean_lora_run
    assert record.scenario == "lora" and record.world_size == 1
    assert record.results["lora_checks"] == []
    assert record.results["lora_checks_run"] == sorted(checks.CHECKS)
    measured = record.results["lora_measured"]
    assert 0 <= measured["logit_deviation"] <= measured["logit_bound"] and measured["weight_error_over_bound"] <= 1
    names = record.param_names
    assert len(names) == ADAPTER_TENSORS and all(checks.is_adapter(n) for n in names)
    assert set(record.digests) == set(names)
    assert sorted(k.removeprefix("step0_grad/") for k in record.arrays if k.startswith("step0_grad/")) == sorted(names)
    assert record.arrays["param_grad_norm"].shape == (3, ADAPTER_TENSORS)
    assert len(record.series["loss"]) == 3 and all(np.isfinite(record.series["loss"]))


def test_a_base_weight_left_trainable_is_caught_in_a_run(tmp_path: Path) -> None:
    """The grad_leak fault (peft leaves one base weight trainable): its gradient at step 0 and its change by the
    optimizer are both found, naming the weight; peft is named."""
    ctx = rank_context(tiny_lora_config(), tmp_path)
    with gloo_world_of_one(tmp_path), injected("lora:mode=grad_leak", ctx) as fault:
        findings = run(ctx).results["lora_checks"]
    assert fault.count > 0  # every wrap: the run's, and the fresh models of the merge and dropout checks
    base = f"{FAULTED_MODULE}.base_layer.weight"
    frozen = [f for f in findings if f["check"] == "frozen-base"]
    assert len(frozen) == 2 and all(base in f["message"] for f in frozen)
    assert "gradient at step 0" in frozen[0]["message"] and "changed" in frozen[1]["message"]
    assert named(frozen) == {("library: peft", "lora-base-left-trainable")}
    # The trained model's base moved and a fresh base did not: the reloaded logits would differ whatever the
    # checkpoint, so the round trip judges its tensors only, which came back. No other check fires, and nothing
    # blames a library's wrapper for what the leak did.
    assert [f for f in findings if f not in frozen] == []


# --- the adapter round trip ----------------------------------------------------------------------------


Roundtrip = Callable[..., list[checks.Finding]]


@pytest.fixture
def roundtrip(tiny: dict[str, Any], one_rank_group: None) -> Roundtrip:
    """The round trip of rank 0 on the tiny Llama with the fixture's adapter: its state dict gathered for the save
    (the fault point ``lora.gather_for_save``), its logits on the fixed batch, then rank.py's ``_roundtrip``.
    ``forward``: a function a library set as the trained model's forward; ``world_size``: the run's."""
    import torch

    def check(world_size: int = 1, forward: Callable[..., Any] | None = None) -> list[checks.Finding]:
        peft_model = adapter.wrap_with_lora(tiny["base"](), tiny["cfg"])
        adapter.load_adapter_tensors(peft_model, tiny["trained"])
        if forward is not None:
            peft_model.forward = forward.__get__(peft_model)
        with torch.no_grad():
            logits = to_numpy(peft_model(input_ids=tiny["batch"]).logits.float())
        wrapped = wrappers.Wrapped(peft_model, peft_model, optimizer=None)
        return _roundtrip(wrapped, gather_for_save(peft_model), tiny["trained"], logits, tiny["base"], tiny["batch"],
                          torch.float32, world_size)

    return check


def test_a_clean_round_trip_passes(roundtrip: Roundtrip) -> None:
    assert roundtrip() == []


def test_a_save_that_zeroes_a_tensor_is_caught_in_the_file_the_reload_and_the_logits(roundtrip: Roundtrip) -> None:
    """The zero_lora_b fault: the file's lora_B is all zeros, so is the reloaded one, and the logits differ; the
    checkpoint is named."""
    with injected("lora:mode=zero_lora_b") as fault:
        findings = roundtrip()
    assert fault.count == 1
    assert [f["check"] for f in findings] == ["adapter-roundtrip"] * 3
    zeroed, reloaded, logits = (f["message"] for f in findings)
    assert zeroed.startswith(f"lora_B of {FAULTED_MODULE} ") and zeroed.endswith("is all zeros in the saved file")
    assert reloaded.startswith(f"lora_B of {FAULTED_MODULE} ") and reloaded.endswith("is all zeros after reload")
    assert logits.startswith("reloaded against trained: logits")
    assert named(findings) == {("checkpoint", "lora-adapter-roundtrip")}


def test_a_save_that_loses_a_tensor_is_caught(roundtrip: Roundtrip) -> None:
    """A save that leaves one lora_A out of the file: missing there, peft's own init in its place after the
    reload, other logits; the checkpoint is named."""

    def without_q_a(original: Any) -> Any:
        def write_adapter(peft_model: Any, state_dict: dict[str, Any], folder: str) -> None:
            original(peft_model, {k: v for k, v in state_dict.items() if k != Q_A}, folder)
        return write_adapter

    with intercepting("lora.write_adapter", without_q_a):
        findings = roundtrip()
    assert [f["check"] for f in findings] == ["adapter-roundtrip"] * 3
    missing, reloaded, logits = (f["message"] for f in findings)
    assert missing.startswith(f"lora_A of {FAULTED_MODULE} ") and missing.endswith("missing from the saved adapter")
    assert reloaded.startswith(f"lora_A of {FAULTED_MODULE} differs in ") and reloaded.endswith(" after reload")
    assert logits.startswith("reloaded against trained: logits")
    assert named(findings) == {("checkpoint", "lora-adapter-roundtrip")}


def test_a_save_of_one_ranks_slice_is_caught_and_the_reload_refuses_it(roundtrip: Roundtrip) -> None:
    """What rank 0 of two holds under FSDP2 (the first half of each tensor's rows) saved as the whole adapter
    (accelerate #4206): every adapter tensor's shape is found to be one rank's slice, and from_pretrained fails on
    the file; the checkpoint is named."""

    def rank0_of_two(original: Any) -> Any:
        def gather(model: Any) -> dict[str, Any]:
            return {name: value[: -(-value.shape[0] // 2)] if checks.is_adapter(name) else value
                    for name, value in original(model).items()}
        return gather

    with intercepting("lora.gather_for_save", rank0_of_two):
        findings = roundtrip(world_size=2)
    sliced = {f["message"].partition(" saved with shape ")[0]: f["message"] for f in findings
              if f["check"] == "sharded-save"}
    assert len(sliced) == ADAPTER_TENSORS
    assert all(message.endswith("one rank's slice, not every rank's") for message in sliced.values())
    shapes = re.search(r"shape \[(\d+), (\d+)\], the full tensor is \[(\d+), (\d+)\]", sliced[f"lora_A of {FAULTED_MODULE}"])
    assert shapes is not None and shapes.groups() == ("4", "64", "8", "64")
    (reload_failed,) = [f["message"] for f in findings if f["check"] == "adapter-roundtrip"]
    assert reload_failed.startswith("PeftModel.from_pretrained failed")
    assert named(findings) == {("checkpoint", "lora-sharded-save"), ("checkpoint", "lora-adapter-roundtrip")}


def test_a_save_that_raises_is_a_finding_not_a_crash(roundtrip: Roundtrip) -> None:
    def failing(original: Any) -> Any:
        def write_adapter(peft_model: Any, state_dict: dict[str, Any], folder: str) -> None:
            raise OSError("disk full")
        return write_adapter

    with intercepting("lora.write_adapter", failing):
        (found,) = roundtrip()
    assert found["check"] == "adapter-roundtrip"
    assert found["message"].startswith("save_pretrained failed") and found["message"].endswith("OSError: disk full")


def forward_nudged(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A forward a library set on the model it prepared: the class's, its logits scaled by 1 + 2**-10."""
    out = type(self).forward(self, *args, **kwargs)
    out.logits = out.logits * (1 + 2.0**-10)
    return out


def test_a_trained_forward_the_reload_lacks_is_the_library_not_the_checkpoint(roundtrip: Roundtrip) -> None:
    """Every tensor comes back bit for bit, yet the logits differ: the trained model ran a forward set on the
    instance, which the finding names; the library is named, not the checkpoint."""
    (found,) = roundtrip(forward=forward_nudged)
    assert found["check"] == "adapter-roundtrip"
    assert found["facts"] == {"tensors_kept": True, "trained_forward": f"{__name__}.forward_nudged"}
    assert named([found]) == {("library", "lora-roundtrip-same-tensors")}
