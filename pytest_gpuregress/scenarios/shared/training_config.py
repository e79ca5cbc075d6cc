"""The config of a training scenario (fsdp, lora, a user's function): shared defaults, the device's values, the
steps asked for and the model's identity. Session side, torch-free."""

from __future__ import annotations

from typing import Any

from ..base import Setup

# What every training scenario starts from; each adds its own and its per-device values.
COMMON: dict[str, Any] = {
    "model": "tiny-llama",
    "steps": 300,
    "seed": 0,
    "data_seed": 1234,
    "warmup_steps": 20,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
}
# The size every training scenario trains at, per device: the model's config folder (models/<model>/<size>), its
# precision and its batch. Each scenario adds its lr and grad_clip (scenario_defaults).
DEVICE_SIZES: dict[str, dict[str, Any]] = {
    "cpu": {"model_size": "cpu", "dtype": "fp32", "global_batch": 16, "seq_len": 64},
    "cuda": {"model_size": "gpu", "dtype": "bf16", "global_batch": 48, "seq_len": 256},
}
# grad_clip is each scenario's, per device: below the typical gradient norm of its model, so that clipping acts on a
# real share of the steps (a clip that never acts leaves a wrong or skipped clip bit-identical). The recording says
# how often it acted (evidence/clipping.py).


def per_device(**tuned: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each device's values: its size (DEVICE_SIZES) and what the scenario tunes for it, e.g.
    ``per_device(cpu={"lr": 3e-3}, cuda={"lr": 6e-4})``."""
    return {device: {**size, **tuned.get(device, {})} for device, size in DEVICE_SIZES.items()}


def training_config(setup: Setup, common: dict[str, Any], per_device: dict[str, dict[str, Any]],
                    model: str | None = None) -> dict[str, Any]:
    """A training scenario's config: common values, the device's, the steps asked for, the identity of ``model`` (a
    user's, --gpuregress-model, trained instead of the scenario's own)."""
    from ...training.models import architecture_of
    from ...training.token_file import describe_for

    config = dict(common)
    config.update(per_device["cuda" if setup.device_kind == "cuda" else "cpu"])
    if setup.steps is not None:
        config["steps"] = int(setup.steps)
    if model is not None:  # the name is its identity with the digest below; the file is where it lives here
        config.update(setup.model(model).config_fields())
        switched = dropout_off(setup, model)
        if switched:  # training/dropout.py; a model without dropout keeps its config and its references
            config["dropout_off"] = switched
    config["model_architecture"] = architecture_of(config)
    # A user's token sample replaces the synthetic data of the user's models only: the built-in models keep theirs
    # (their vocabulary is 256; real traffic's is 32k and more).
    tokens = describe_for(config, setup.tokens if model is not None else None)
    if tokens is not None:
        config["tokens"] = tokens
    return config


def dropout_off(setup: Setup, model: str) -> dict[str, float]:
    """The stochastic config fields training switches off for a user's model (none for a factory's: its dropout
    modules are silenced on the ranks, and its code is not a config file to read here)."""
    from ...training.dropout import config_file_dropout

    spec = setup.model(model)
    return {} if spec.factory else dict(config_file_dropout(spec.config_file(setup.device_kind)))
