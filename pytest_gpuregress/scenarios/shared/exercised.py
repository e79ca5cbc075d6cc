"""What the built-in training cases exercise (activities.py), shared by fsdp, lora, checkpoint and triage.

Each case's declaration is built here from what it does: which AdamW it steps with, whether it clips, whether it
trains from step 0 or resumes, which collectives its wrapper runs on this device, whether it trains in bf16.
faults/reach.py judges injected faults against it. Session side, torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable

from ... import activities as act
from ..base import Setup

ON_CPU_FP32 = "on a CPU this case trains in fp32: fsdp-bf16 casts to bf16 there"


def trained(setup: Setup, *, adamw: str, clips: bool = True, from_step_0: bool = True,
            collectives: Iterable[str] = (act.ANY,), bf16: bool | None = None, more: Iterable[str] = (),
            absent: dict[str, str] | None = None, summary: str = "") -> act.Exercises:
    """A tiny Llama (or a user's model) trained on this run's ranks. ``bf16``: it casts to bf16 (default: on GPUs,
    where the training scenarios train in bf16); ``collectives``: the ops its wrapper runs (every one by default)."""
    casts = setup.device_kind == "cuda" if bf16 is None else bf16
    does = [act.STEP, act.FORWARD, act.LLAMA_FORWARD, act.adamw(adamw), *(act.collective(op) for op in collectives),
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
