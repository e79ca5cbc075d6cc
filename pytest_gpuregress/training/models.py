"""Build tiny models from the config files in ``models/``, with platform-independent init (seeding.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..resources import shipped_dir
from .dropout import silence_modules, switch_off
from .factory import FactoryModel, factory_model

# Below this module, so that factory.py uses them without importing it back; still found here by their callers.
from .fsdp2 import decoder_layers as decoder_layers
from .meta_build import without_init
from .seeding import seed_parameters
from .seeding import seeded_normal as seeded_normal

# The tiny Llama at GPU size (models/tiny-llama/gpu): what its checkpoints weigh is said before any is built.
TINY_LLAMA_GPU_PARAMETERS = 155_730_944


def config_path(name: str, size: str) -> Path:
    """The config file of model ``name`` at ``size`` (cpu or gpu): a shipped model's, or the user's file (or folder
    holding a ``config.json``) ``name`` is."""
    users = _user_config(name)
    if users is not None:
        return users
    root = shipped_dir("models")
    path = root / name / size / "config.json"
    if not path.is_file():
        known = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise FileNotFoundError(f"{path}: no such model config; known models: {known}. "
                                "Pass a transformers config file (or a folder containing config.json) instead.")
    return path


def _user_config(name: str) -> Path | None:
    """The config file a path names (the file, or a folder's config.json); None for a bare name or no such file."""
    candidate = Path(name)
    if not (candidate.is_absolute() or "/" in name or candidate.suffix == ".json"):
        return None
    if candidate.suffix == ".json" and candidate.is_file():
        return candidate
    if candidate.is_dir() and (candidate / "config.json").is_file():
        return candidate / "config.json"
    return None


def model_source(cfg: dict[str, Any]) -> str:
    """What a scenario config's model is read from: a user's config file (``model_file``, --gpuregress-model),
    else the shipped model ``model``."""
    return str(cfg.get("model_file") or cfg["model"])


def model_dir(name: str, size: str) -> Path:
    """The folder of model ``name``'s config file."""
    return config_path(name, size).parent


def load_config(name: str, size: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(config_path(name, size)), local_files_only=True)


# Keys of a config.json that say who wrote the file or how to run it, not what the model is: a
# transformers upgrade rewrites transformers_version, so it must never make a reference foreign.
NOT_ARCHITECTURE = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
                              "output_attentions", "output_hidden_states", "return_dict"})


def architecture_digest(name: str, size: str) -> str:
    """A short hash of the config file without version stamps and run switches, stored with references (another
    architecture is foreign). Read from the file: a transformers config gains defaults every release."""
    import hashlib
    import json

    path = config_path(name, size)
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON model config ({exc})") from None
    identity = {k: v for k, v in fields.items() if k not in NOT_ARCHITECTURE}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def build_causal_lm(config: Any, seed: int) -> Any:
    """A causal LM on the CPU in fp32, initialised from ``seed``: from a transformers ``config``, or from the
    user's factory (a FactoryModel, training/factory.py) in its place."""
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(config, FactoryModel):
        with isolated_generators():
            model = config.build(seed)
        silence_modules(model)
        return model
    switch_off(config)  # training/dropout.py: masks cannot be compared across ranks or stacks
    # Parameters on meta (meta_build.py): the library's init, overwritten below, costs nothing. What it draws
    # stays out of the training's generators, so its init order, or a plain build after all, changes nothing.
    with isolated_generators(), torch.device("cpu"):
        model, _ = without_init(lambda: AutoModelForCausalLM.from_config(config))  # float32, torch's default dtype
    silence_modules(model)
    seed_parameters(model, seed, float(getattr(config, "initializer_range", 0.02)))
    return model


@contextlib.contextmanager
def isolated_generators() -> Iterator[None]:
    """Python's, numpy's and torch's CPU generators as they were before the block, whatever it drew."""
    import random

    import torch

    python, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


def blueprint(cfg: dict[str, Any]) -> Any:
    """What a scenario config's model is built from: a transformers config (shipped or the user's), or the user's
    factory (``model_factory``: a FactoryModel with the fields the scenarios read)."""
    if cfg.get("model_factory"):
        return factory_model(str(cfg["model_factory"]))
    return load_config(model_source(cfg), cfg["model_size"])


def ties_embeddings(cfg: dict[str, Any]) -> bool | None:
    """Whether a scenario config's model ties its embeddings (``tie_word_embeddings``, a multimodal one's text
    config's); None for a factory's model or an unreadable config (the comparison then judges the layout alone)."""
    if cfg.get("model_factory") or "model_size" not in cfg:
        return None
    try:
        config = blueprint(cfg)
    except Exception:  # noqa: BLE001 - a judgement aid: the run itself reported what it could not build
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", None))
    return bool(tied) if tied is not None else None


def describe_model(cfg: dict[str, Any]) -> str:
    """Where a scenario config's model comes from, for messages: "the config <file>" or "the factory <entry>"."""
    if cfg.get("model_factory"):
        return f"the factory {cfg['model_factory']}"
    return f"the config {config_path(model_source(cfg), cfg['model_size'])}"


def architecture_of(cfg: dict[str, Any]) -> str:
    """The identity of a scenario config's model: its config file's digest, or a factory model's structure."""
    if cfg.get("model_factory"):
        return factory_model(str(cfg["model_factory"])).digest
    return architecture_digest(model_source(cfg), cfg["model_size"])
