"""Dropout and RNG isolation (training/dropout.py, training/models.py): stochastic layers are trained switched off,
recorded and reported, and what a library draws while building a model never reaches the training's generators."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GPT2Config, MixtralConfig

from pytest_gpuregress.scenarios.base import Setup
from pytest_gpuregress.scenarios.fsdp import SCENARIO as FSDP
from pytest_gpuregress.training import dropout, models
from pytest_gpuregress.training.model_specs import parse_models

from ..conftest import record_references

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 256, "n_positions": 64,
        "n_embd": 32, "n_layer": 2, "n_head": 2, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "initializer_range": 0.02, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}


def tiny_gpt2() -> GPT2Config:
    return GPT2Config(**{k: v for k, v in GPT2.items() if k not in ("architectures", "model_type")})


def test_stochastic_fields_are_found_and_switched_off() -> None:
    config = tiny_gpt2()
    assert dropout.stochastic_fields(config) == {"attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1,
                                                  "summary_first_dropout": 0.1}
    assert dropout.switch_off(config)["resid_pdrop"] == 0.1
    assert dropout.stochastic_fields(config) == {}
    mixtral = MixtralConfig(router_jitter_noise=0.01, attention_dropout=0.0)
    assert dropout.stochastic_fields(mixtral) == {"router_jitter_noise": 0.01}  # a 0.0 field is not listed


def test_a_built_model_trains_with_every_dropout_module_at_zero() -> None:
    model = models.build_causal_lm(tiny_gpt2(), seed=0)
    ps = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert ps and all(p == 0.0 for p in ps)
    model.train()
    ids = torch.arange(16).reshape(2, 8)
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # no mask: two passes agree


def test_what_a_library_draws_while_building_never_reaches_the_training_generators(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    def states() -> tuple[bytes, tuple, object]:
        return torch.get_rng_state().numpy().tobytes(), random.getstate(), np.random.get_state()[1].tobytes()

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    before = states()
    plain = models.build_causal_lm(tiny_gpt2(), seed=0)
    assert states() == before
    real = AutoModelForCausalLM.from_config

    def hungry(*args: object, **kwargs: object) -> object:  # a release that initialises in another order
        torch.rand(1000), random.random(), np.random.rand(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", hungry)
    greedy = models.build_causal_lm(tiny_gpt2(), seed=0)
    assert states() == before  # the training's draws start where they would have
    for (name, a), (_, b) in zip(plain.state_dict().items(), greedy.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_stored_config_and_header_say_what_was_switched_off(tmp_path: Path) -> None:
    (tmp_path / "tiny-gpt2.json").write_text(json.dumps(GPT2))
    setup = Setup("cpu", "gloo", 2, models=parse_models(["tiny-gpt2.json"], tmp_path))
    # What the file sets: a library default (GPT2Config's summary_first_dropout 0.1) is switched off in training
    # too, but stays out of the stored config, so a release changing its defaults cannot make the reference foreign.
    assert FSDP.model_config(setup, "tiny-gpt2")["dropout_off"] == {"attn_pdrop": 0.1, "embd_pdrop": 0.1,
                                                                    "resid_pdrop": 0.1}
    assert "dropout_off" not in FSDP.default_config(setup)  # the tiny Llama has none: its references stay as they are
    [line] = FSDP.header(setup)
    header, _, said = line.partition(": ")
    assert header == "gpuregress dropout (tiny-gpt2)" and said.startswith("switched off for training (")
    assert line.index("attn_pdrop 0.1") < line.index("embd_pdrop 0.1") < line.index("resid_pdrop 0.1")


@pytest.mark.full_tier
def test_a_dropout_model_passes_fsdp_lora_and_triage_clean_and_a_collective_fault_is_still_caught(tmp_path: Path) -> None:
    (tmp_path / "tiny-gpt2.json").write_text(json.dumps(GPT2))
    model = "--gpuregress-model=tiny-gpt2.json"
    select = ["-k", "tiny-gpt2 and (fsdp or lora)", "--gpuregress-steps=8"]
    refs = record_references(tmp_path, model, *select, "--gpuregress-replicas=0")

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", model,
                               f"--gpuregress-reference-dir={refs}", *select, "-rA", *extra],
                              cwd=tmp_path, capture_output=True, text=True, timeout=900)

    clean = run()
    # fsdp, both lora wrappers, and triage's equivalence (2 ranks against 1) and oracle (float64) for the model
    assert clean.returncode == 0, clean.stdout[-3000:]
    assert "5 passed" in clean.stdout and "dropout (tiny-gpt2): switched off" in clean.stdout
    # The fsdp case alone (a later -k wins): triage's experiments for the lora cases would add minutes, not evidence.
    # Its default evidence decides (the run's own collective invariants); the flips' cold replays add minutes too.
    faulted = run("--gpuregress-inject=collective:op=reduce_scatter,mode=nudge,rel=1e-3",
                  "-k", "tiny-gpt2 and fsdp and not lora")
    assert "FAILED gpuregress::fsdp-tiny-gpt2" in faulted.stdout, faulted.stdout[-3000:]
    assert "triage verdict: collective." in faulted.stdout  # named the collective, not the dropout masks
