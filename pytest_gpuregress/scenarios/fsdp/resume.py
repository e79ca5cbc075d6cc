"""The fsdp scenario's resume from its reference, on one rank: the roles of its two launches.

  save      recording: the run's first S = steps // 2 steps, trained as rank.py trains them; then the
            whole training state saved (training/resume_checkpoint.py: DCP in safetensors, JSON) into
            the folder the session named, and its digests per piece (training/state_digests.py). The
            reference keeps both: the folder as ``resume/``, the digests in its results.
  continue  comparing: a freshly built trainer, every generator scrambled, the reference's checkpoint
            loaded from its ``resume/`` folder (read only), the digests of what was loaded, then steps S
            to the end with the shared loop: the continuation the session judges against the
            reference's own last steps.
The model, optimizer, data and step are rank.py's (a noise replica's perturbation aside): on the
recording stack the continuation repeats the reference's last steps bit for bit, which the e2e test checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...reference.record import RunRecord, float_digest
from ...training.optimizer import AdamWSettings, Optimization, Optimized, Schedule, adamw
from ..base import RankContext

ENTRY = "pytest_gpuregress.scenarios.fsdp.resume:run"
ROLE = "resume_role"  # session-only config keys: kept out of the record's config
FOLDER = "resume_folder"
SESSION_ONLY = (ROLE, FOLDER)
RESULT_KEY = "resume"  # this launch's results: the step, the digests, or why it could not load
SCRAMBLE_SEED = 876_543_219  # generators before the load: a value no run seeds with


def resume_step(config: dict[str, Any]) -> int:
    """S: the steps the checkpoint has taken; the continuation runs S to the end."""
    return int(config["steps"]) // 2


def stored(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in SESSION_ONLY}


@dataclass
class FsdpTrainer(Optimized):
    """rank.py's model under FSDP2, its AdamW and schedule, and its data (the batch of step s is batch s)."""

    model: Any
    names: list[str]
    optimization: Optimization
    data: Any


def build(ctx: RankContext) -> FsdpTrainer:
    """The trainer rank.py builds, at step 0."""
    import torch

    from ...training.data import token_source
    from ...training.fsdp2 import mixed_precision, shard
    from ...training.models import blueprint, build_causal_lm
    from ...training.shard_units import shard_units
    from ...training.switches import apply_switches

    cfg = ctx.config
    model_config = blueprint(cfg)
    model = build_causal_lm(model_config, seed=int(cfg["seed"]))
    apply_switches(cfg, ctx)
    model = model.to(torch.device(ctx.device))
    shard(shard_units(model), mp_policy=mixed_precision(cfg["dtype"]))
    named = list(model.named_parameters())
    optimization = Optimization.of(adamw([p for _, p in named], AdamWSettings.from_config(cfg)),
                                   Schedule.from_config(cfg))
    return FsdpTrainer(model, [n for n, _ in named], optimization, token_source(cfg, model_config.vocab_size))


def _train(ctx: RankContext, trainer: FsdpTrainer, steps: range, first_batch: int, progress: str) -> Any:
    """``steps`` with the shared loop; step s reads batch ``first_batch + (s - steps.start)``."""
    import torch

    from ...training.loop import TrainStep, clip_gradients, train
    from ...training.step import next_token_loss, rank_tokens

    device = torch.device(ctx.device)
    params = trainer.params
    step = TrainStep(
        loss=lambda s: next_token_loss(trainer.model, rank_tokens(trainer.data, first_batch + s - steps.start, ctx, "",
                                                                  device)),
        optimization=trainer.optimization,
        clip=lambda: clip_gradients(params, float(ctx.config["grad_clip"])),
        tracked=params,
    )
    return train(ctx, step, steps, progress=progress)


def _record(ctx: RankContext, results: dict[str, Any], **fields: Any) -> RunRecord:
    return RunRecord(scenario="fsdp", config=stored(ctx.config), platform_key="", world_size=ctx.world_size,
                     results={RESULT_KEY: results}, **fields)


def run_save(ctx: RankContext) -> RunRecord:
    """Recording: S steps, the save, the digests of the state saved."""
    from ...training import dcp_safetensors, resume_checkpoint, state_digests

    unavailable = dcp_safetensors.unavailable()
    if unavailable:
        return _record(ctx, {"unavailable": unavailable})
    start = resume_step(ctx.config)
    trainer = build(ctx)
    curves = _train(ctx, trainer, range(start), 0, "training to the resume checkpoint")
    ctx.progress("saving the resume checkpoint")
    resume_checkpoint.save(trainer, Path(ctx.config[FOLDER]), step=start, data_position=start, rank=ctx.rank,
                           world_size=ctx.world_size, device_kind=ctx.device_kind)
    boundary = state_digests.boundary(trainer, start, ctx.device_kind, ctx.rank)  # after the save: one that moves state shows
    return _record(ctx, {"step": start, "boundary": boundary},
                   series={"loss": curves.losses, "grad_norm": curves.grad_norms})


def run_continue(ctx: RankContext) -> RunRecord:
    """Comparing: the reference's checkpoint loaded on this stack, then steps S to the end."""
    from ...training import dcp_safetensors, resume_checkpoint, rng_state, state_digests

    unavailable = dcp_safetensors.unavailable()
    if unavailable:
        return _record(ctx, {"unavailable": unavailable})
    trainer = build(ctx)
    rng_state.scramble(SCRAMBLE_SEED + ctx.rank, ctx.device_kind)
    ctx.progress("loading the reference's resume checkpoint")
    try:
        meta = resume_checkpoint.load(trainer, Path(ctx.config[FOLDER]), rank=ctx.rank, device_kind=ctx.device_kind)
    except Exception as exc:  # noqa: BLE001 - a load that fails is the finding, named by the verdict
        first = (str(exc).strip().splitlines() or [""])[0]
        return _record(ctx, {"load_error": f"{type(exc).__name__}: {first}"})
    start, position = int(meta["step"]), int(meta["data_position"])
    boundary = state_digests.boundary(trainer, position, ctx.device_kind, ctx.rank)  # what step S is about to see
    state_digests.as_saved(boundary, trainer, meta["param_groups"], meta["scheduler"])
    curves = _train(ctx, trainer, range(start, int(ctx.config["steps"])), position, "resumed training")
    digests = {name: float_digest(p.detach().full_tensor().float().cpu().numpy())
               for name, p in zip(trainer.names, trainer.params)}
    return _record(ctx, {"step": start, "boundary": boundary, "saved_with_torch": meta.get("torch")},
                   series={"loss": curves.losses, "grad_norm": curves.grad_norms}, param_names=list(trainer.names),
                   arrays={"param_grad_norm": curves.param_norms(len(trainer.names))}, digests=digests)


ROLES: dict[str, Callable[[RankContext], RunRecord]] = {"save": run_save, "continue": run_continue}


def run(ctx: RankContext) -> RunRecord:
    return ROLES[ctx.config[ROLE]](ctx)
