"""Rank side of a resume from a reference's own checkpoint: the two roles of its launches, for any trainer.

``save`` (recording: S = 3/4 of the steps, then the state and its digests) and ``continue`` (comparing: a fresh
trainer, generators scrambled, the reference's checkpoint loaded, steps S to the end), over a scenario's
``ResumableTrainer``. Torch is imported inside the functions: the session imports this for its config keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...evidence import step0
from ...reference.record import RunRecord, float_digest
from ...training.resume_checkpoint import Resumable
from ..base import RankContext
from .gradient_capture import capture
from .late_gradients import LATE_ONLY

if TYPE_CHECKING:
    from ...training.loop import Curves

ROLE = "resume_role"  # session-only config keys: kept out of the record's config
FOLDER = "resume_folder"
SESSION_ONLY = (ROLE, FOLDER, LATE_ONLY)
RESULT_KEY = "resume"  # a resume launch's results: the step, the digests, or why it could not load
SCRAMBLE_SEED = 876_543_219  # generators before the load: a value no run seeds with


def resume_step(config: dict[str, Any]) -> int:
    """S: the steps the checkpoint has taken; the continuation runs S to the end. Late (3/4 of the run: step 225 of
    300), so the late gradients judged from it see a fault that starts as late as that."""
    return int(config["steps"]) * 3 // 4


def stored(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in SESSION_ONLY}


class ResumableTrainer(Resumable, Protocol):
    """A scenario's trainer at step 0, as its rank.py builds it, that can train a range of steps."""

    def train(self, ctx: RankContext, steps: range, first_batch: int, progress: str,
              inspect: Callable[[int], None] | None = None) -> Curves:
        """``steps`` with the shared loop; step s reads batch ``first_batch + (s - steps.start)``. ``inspect``:
        TrainStep's look at each step's gradients."""
        ...

    def weights(self) -> dict[str, np.ndarray]:
        """The whole trained tensors by name, as the scenario's own run digests them (collective)."""
        ...


@dataclass(frozen=True)
class Roles:
    """The save and continue roles of ``scenario``, whose trainer ``build`` makes."""

    scenario: str
    build: Callable[[RankContext], ResumableTrainer]

    def run(self, ctx: RankContext) -> RunRecord:
        from ...training import dcp_safetensors

        unavailable = dcp_safetensors.unavailable()
        if unavailable:
            return self._record(ctx, {"unavailable": unavailable})
        return {"save": self.save, "continue": self.resume}[ctx.config[ROLE]](ctx)

    def _record(self, ctx: RankContext, results: dict[str, Any], **fields: Any) -> RunRecord:
        return RunRecord(scenario=self.scenario, config=stored(ctx.config), platform_key="", world_size=ctx.world_size,
                         results={RESULT_KEY: results}, **fields)

    def save(self, ctx: RankContext) -> RunRecord:
        """Recording: S steps, the save, the digests of the state saved."""
        from ...training import resume_checkpoint, state_digests

        start = resume_step(ctx.config)
        trainer = self.build(ctx)
        curves = trainer.train(ctx, range(start), 0, "training to the resume checkpoint")
        ctx.progress("saving the resume checkpoint")
        resume_checkpoint.save(trainer, Path(ctx.config[FOLDER]), step=start, data_position=start, rank=ctx.rank,
                               world_size=ctx.world_size, device_kind=ctx.device_kind)
        # After the save: a save that moves state shows.
        boundary = state_digests.boundary(trainer, start, ctx.device_kind, ctx.rank)
        return self._record(ctx, {"step": start, "boundary": boundary}, series=curves.series())

    def resume(self, ctx: RankContext) -> RunRecord:
        """Comparing: the reference's checkpoint loaded on this stack, then steps S to the end."""
        from ...training import resume_checkpoint, rng_state, state_digests
        from ...training.noise import perturb_weights

        trainer = self.build(ctx)
        rng_state.scramble(SCRAMBLE_SEED + ctx.rank, ctx.device_kind)
        state_digests.scramble_frozen(trainer)  # built equal to the saved ones: only a load may restore them
        ctx.progress("loading the reference's resume checkpoint")
        try:
            meta = resume_checkpoint.load(trainer, Path(ctx.config[FOLDER]), rank=ctx.rank, device_kind=ctx.device_kind)
        except Exception as exc:  # noqa: BLE001 - a load that fails is the finding, named by the verdict
            first = (str(exc).strip().splitlines() or [""])[0]
            return self._record(ctx, {"load_error": f"{type(exc).__name__}: {first}"})
        start, position = int(meta["step"]), int(meta["data_position"])
        boundary = state_digests.boundary(trainer, position, ctx.device_kind, ctx.rank)  # what step S is about to see
        state_digests.as_saved(boundary, trainer, meta["param_groups"], meta["scheduler"])
        late_only = bool(ctx.config.get(LATE_ONLY))
        if late_only:  # a noise replica of the late gradients: its perturbation on the state it loaded
            perturb_weights(trainer.params, str(ctx.config.get("perturbation", "")), str(ctx.config["dtype"]))
        keep, late = capture(list(trainer.names), trainer.params, ctx, start, step0.LATE)
        end = start + 1 if late_only else int(ctx.config["steps"])
        curves = trainer.train(ctx, range(start, end), position, "resumed training", inspect=keep)
        results = {"step": start, "boundary": boundary, "saved_with_torch": meta.get("torch")}
        if late_only:
            return self._record(ctx, results, arrays=late)
        digests = {name: float_digest(values) for name, values in trainer.weights().items()}
        return self._record(ctx, results, series=curves.series(), param_names=list(trainer.names),
                            arrays={"param_grad_norm": curves.param_norms(len(trainer.names)), **late}, digests=digests)
