"""A training scenario's config (scenarios/shared/training_config.py): the shared defaults, the device's size and
tuning, the steps asked for, and a user's model's identity, its dropout switched off and its token sample."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_gpuregress.scenarios.base import Setup
from pytest_gpuregress.scenarios.shared.training_config import (
    COMMON,
    DEVICE_SIZES,
    dropout_off,
    per_device,
    training_config,
)
from pytest_gpuregress.training.model_specs import ModelSpec
from pytest_gpuregress.training.models import architecture_of, config_path

TUNED = per_device(cpu={"lr": 3e-3, "grad_clip": 0.5}, cuda={"lr": 6e-4, "seq_len": 128})


def users_model(tmp_path: Path, **fields: Any) -> ModelSpec:
    """The tiny Llama's CPU config with ``fields`` changed, as a user's --gpuregress-model file."""
    config = {**json.loads(config_path("tiny-llama", "cpu").read_text()), **fields}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(config))
    return ModelSpec("mine", str(path))


def test_per_device_adds_each_devices_tuning_to_its_size() -> None:
    """Every device gets its size; what a scenario tunes is added, and may override a size (cuda's seq_len)."""
    assert TUNED["cpu"] == {**DEVICE_SIZES["cpu"], "lr": 3e-3, "grad_clip": 0.5}
    assert TUNED["cuda"] == {**DEVICE_SIZES["cuda"], "lr": 6e-4, "seq_len": 128}
    assert per_device() == DEVICE_SIZES


@pytest.mark.parametrize(("device", "steps"), [("cpu", None), ("cuda", 12)])
def test_the_config_is_the_defaults_the_devices_values_and_the_steps_asked_for(device: str, steps: int | None) -> None:
    """The tiny Llama on each device: COMMON, then that device's values, then --gpuregress-steps; the model's
    identity is its architecture digest; no token file, no dropout switched off."""
    setup = Setup(device, "gloo" if device == "cpu" else "nccl", 2, steps=steps)  # type: ignore[arg-type]
    config = training_config(setup, COMMON, TUNED)
    expected = {**COMMON, **TUNED[device], "steps": steps or COMMON["steps"]}
    assert {k: config[k] for k in expected} == expected
    assert set(config) - set(expected) == {"model_architecture"}
    assert config["model_architecture"] == architecture_of(expected)


def test_a_users_model_brings_its_file_its_architecture_and_its_dropout_switched_off(tmp_path: Path) -> None:
    """A user's model: named by its spec, read from its file, its own architecture digest, and the config's
    dropout fields recorded as switched off (training runs without them)."""
    spec = users_model(tmp_path, attention_dropout=0.1)
    setup = Setup("cpu", "gloo", 2, models=(spec,))
    config = training_config(setup, COMMON, TUNED, model="mine")
    plain = training_config(setup, COMMON, TUNED)
    assert (config["model"], config["model_file"]) == ("mine", spec.source)
    assert config["dropout_off"] == {"attention_dropout": 0.1} == dropout_off(setup, "mine")
    assert config["model_architecture"] != plain["model_architecture"]
    assert "model_file" not in plain and "dropout_off" not in plain


def test_a_model_without_dropout_keeps_its_config_unmarked(tmp_path: Path) -> None:
    """No stochastic field: no ``dropout_off`` key, so its references stay those of a config without one; a
    factory's model: none read from a file (its modules are silenced on the ranks)."""
    setup = Setup("cpu", "gloo", 2, models=(users_model(tmp_path), ModelSpec("made", "pkg.mod:made", factory=True)))
    assert "dropout_off" not in training_config(setup, COMMON, TUNED, model="mine")
    assert dropout_off(setup, "made") == {}


def test_a_token_sample_is_trained_by_the_users_models_only(tmp_path: Path) -> None:
    """--gpuregress-tokens: a user's model reads the file (its identity in the config); the tiny Llama keeps its
    synthetic data, so its references stand."""
    ids = np.arange(1000, dtype=np.int64) % 256
    tokens = tmp_path / "ids.npy"
    np.save(tokens, ids)
    setup = Setup("cpu", "gloo", 2, tokens=tokens, models=(users_model(tmp_path),))
    described = training_config(setup, COMMON, TUNED, model="mine")["tokens"]
    assert (described["file"], described["count"]) == (str(tokens.resolve()), 1000)
    assert described["sha256"] == hashlib.sha256(ids.tobytes()).hexdigest()
    assert "tokens" not in training_config(setup, COMMON, TUNED)
