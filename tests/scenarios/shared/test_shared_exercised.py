"""What a built-in training case declares it exercises (scenarios/shared/exercised.py), from what it does: the
activities a fault's reach is judged against (activities.py), with the reason a CPU case lacks bf16, a user's
model's own code and tying, and what a resumed case no longer runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuregress import activities as act
from pytest_gpuregress.scenarios.base import Setup
from pytest_gpuregress.scenarios.shared.exercised import ON_CPU_FP32, resumed, runs_llama_code, ties_embeddings, trained
from pytest_gpuregress.training.model_specs import ModelSpec

CPU, CUDA = Setup("cpu", "gloo", 2), Setup("cuda", "nccl", 2)
BASE = {act.STEP, act.FORWARD, act.SYNTHETIC_TOKENS, act.LLAMA_FORWARD, act.adamw("fused"), act.collective(), act.CLIP,
        act.FROM_STEP_0}


def with_model(tmp_path: Path, name: str, config: Any) -> Setup:
    """A CPU setup whose --gpuregress-model ``name`` is a config file holding ``config`` (JSON; a str as it is)."""
    path = tmp_path / f"{name}.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return Setup("cpu", "gloo", 2, models=(ModelSpec(name, str(path)),))


def test_a_cpu_case_trains_in_fp32_and_says_why_bf16_faults_miss_it() -> None:
    """The tiny Llama on a CPU: every training activity but the bf16 cast, whose absence has its reason, so a bf16
    fault is reported as not reaching the case rather than as a pass."""
    case = trained(CPU, adamw="fused")
    assert case.does == BASE
    assert not act.meets([act.BF16_CAST], case.does)
    assert act.reason_absent([act.BF16_CAST], case) == ON_CPU_FP32
    assert act.meets([act.collective("reduce_scatter")], case.does)  # every collective by default


def test_a_gpu_case_casts_to_bf16_and_each_switch_changes_its_activity() -> None:
    """On a GPU the case casts to bf16; clips=False, from_step_0=False, bf16=False, named collectives and ``more``
    each change exactly their activity, and ``absent`` is kept as given."""
    assert trained(CUDA, adamw="fused").does == BASE | {act.BF16_CAST}
    case = trained(CUDA, adamw="single", clips=False, from_step_0=False, bf16=False, collectives=("all_reduce",),
                   more=(act.PEFT_LORA,), absent={act.ADAPTER_SHARDS: "DDP"}, summary="lora")
    assert case.does == (BASE - {act.CLIP, act.FROM_STEP_0, act.adamw("fused"), act.collective()}) | {
        act.adamw("single"), act.collective("all_reduce"), act.PEFT_LORA}
    assert dict(case.absent) == {act.ADAPTER_SHARDS: "DDP"} and case.summary == "lora"  # bf16 off by choice: no reason
    assert not act.meets([act.collective("reduce_scatter")], case.does)


def test_a_resumed_case_restores_state_and_never_runs_its_early_steps_or_saves() -> None:
    """resumed(): from step 0 and the adapter save gone, the optimizer state load and the restore added; the
    summary and the reasons kept."""
    case = trained(CPU, adamw="fused", more=(act.ADAPTER_SAVE, act.ADAPTER_SHARDS), summary="s")
    again = resumed(case)
    assert again.does == (case.does - {act.FROM_STEP_0, act.ADAPTER_SAVE, act.ADAPTER_SHARDS}) | {
        act.OPTIMIZER_STATE_LOAD, act.RESUME_RESTORE}
    assert again.summary == "s" and again.absent == case.absent


@pytest.mark.parametrize(("config", "llama", "tied"), [
    ({"model_type": "gpt2"}, False, True),  # tied: transformers' default for every config class but Llama's
    ({"model_type": "gpt2", "tie_word_embeddings": False}, False, False),
    ({"model_type": "llama"}, True, False),
    ({"model_type": "llama", "tie_word_embeddings": True}, True, True),
    ({"model_type": "llava", "text_config": {"model_type": "llama"}}, True, False),  # a multimodal model's text model
    ("not json", True, True),  # unreadable here: counted as running both (the session reports the file)
])
def test_a_users_model_runs_its_own_code_and_ties_as_its_config_says(tmp_path: Path, config: Any, llama: bool,
                                                                     tied: bool) -> None:
    """A user's model exercises Llama's forward only where its config says llama, and tied embeddings where its
    config (or transformers' default for its class) ties them; the case's activities follow."""
    setup = with_model(tmp_path, "mine", config)
    assert runs_llama_code(setup, "mine") is llama
    assert ties_embeddings(setup, "mine") is tied
    assert (act.LLAMA_FORWARD in trained(setup, adamw="fused", model="mine").does) is llama


def test_the_tiny_llama_and_a_factory_model() -> None:
    """No model named: the tiny Llama, Llama code, untied. A factory's model: its code unknown here, so counted."""
    assert runs_llama_code(CPU, None) and not ties_embeddings(CPU, None)
    factory = Setup("cpu", "gloo", 2, models=(ModelSpec("made", "pkg.mod:made", factory=True),))
    assert runs_llama_code(factory, "made") and ties_embeddings(factory, "made")
