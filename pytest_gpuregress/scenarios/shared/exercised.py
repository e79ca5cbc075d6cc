"""What the built-in training cases exercise (activities.py), shared by fsdp, lora, checkpoint and triage.

Each declaration is built from what the case does (its AdamW, clipping, resume, collectives, bf16), so
faults/reach.py can judge injected faults against it. Session side, torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ... import activities as act
from ..base import Setup

ON_CPU_FP32 = "on a CPU this case trains in fp32: fsdp-bf16 casts to bf16 there"


def _config(setup: Setup, model: str) -> dict[str, Any] | None:
    """A user's model's config.json (its text config in a multimodal one); None for a factory's or one unreadable
    here (the session reports that)."""
    spec = setup.model(model)
    if spec.factory:
        return None
    try:
        config = json.loads(Path(spec.config_file(setup.device_kind)).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def runs_llama_code(setup: Setup, model: str | None) -> bool:
    """Whether the model runs transformers' Llama code (the tiny Llama does; a factory's model may: counted)."""
    config = _config(setup, model) if model is not None else {"model_type": "llama"}
    return config is None or config.get("model_type") == "llama"


def ties_embeddings(setup: Setup, model: str | None) -> bool:
    """Whether the model's config ties its input and output embeddings (the tiny Llama's does not; a factory's
    may: counted). Absent, transformers' default: tied, but for Llama's config class."""
    if model is None:
        return False
    config = _config(setup, model)
    if config is None:
        return True
    return bool(config.get("tie_word_embeddings", config.get("model_type") != "llama"))


def trained(setup: Setup, *, adamw: str, clips: bool = True, from_step_0: bool = True,
            collectives: Iterable[str] = (act.ANY,), bf16: bool | None = None, more: Iterable[str] = (),
            absent: dict[str, str] | None = None, summary: str = "", model: str | None = None) -> act.Exercises:
    """The tiny Llama (or the user's ``model``) trained on this run's ranks. ``bf16``: it casts to bf16 (default:
    on GPUs, where the training scenarios train in bf16); ``collectives``: the ops its wrapper runs (every one
    by default)."""
    casts = setup.device_kind == "cuda" if bf16 is None else bf16
    llama = (act.LLAMA_FORWARD,) if runs_llama_code(setup, model) else ()
    does = [act.STEP, act.FORWARD, act.SYNTHETIC_TOKENS, *llama, act.adamw(adamw), *(act.collective(op) for op in collectives),
            *([act.CLIP] if clips else []), *([act.FROM_STEP_0] if from_step_0 else []),
            *([act.BF16_CAST] if casts else []), *more]
    why = dict(absent or {})
    if not casts and bf16 is None:
        why[act.BF16_CAST] = ON_CPU_FP32
    return act.exercises(*does, summary=summary, absent=why)


def resumed(exercised: act.Exercises) -> act.Exercises:
    """The same training continued from a checkpoint: its state restored, its early steps never run, and nothing
    saved at the end."""
    does = exercised.does - {act.FROM_STEP_0, act.ADAPTER_SAVE, act.ADAPTER_SHARDS}
    return act.Exercises(does | {act.OPTIMIZER_STATE_LOAD, act.RESUME_RESTORE}, exercised.summary, exercised.absent)
