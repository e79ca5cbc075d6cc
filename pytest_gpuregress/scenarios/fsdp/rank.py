"""The fsdp scenario on one rank: FSDP2 training of a tiny Llama, recording what a regression moves.

fp32 on the CPU, bf16 parameters with fp32 gradient reduction on GPUs. The record keeps per-step loss and
gradient norms, full step-0 gradients and final parameter digests. Step-0 gradients are the sharpest signal:
a corrupted reduce-scatter shows there element by element long before the loss moves (docs/faults.md, section 1).
"""

from __future__ import annotations

from typing import Any

from ...evidence import step0 as step0_arrays
from ...evidence.op_tracer import for_rank as op_tracer
from ...reference.record import RunRecord, float_digest
from ...training import bf16_checkpoint
from ...training.fsdp2 import RESULT_KEY
from ...training.loop import train_observed, training_record
from ...training.models import build_causal_lm
from ...training.moe import is_moe, mean_expert_load
from ...training.noise import apply_kernel_path, apply_switches, apply_weight_perturbation
from ...training.step import rank_tokens
from ..base import RankContext
from ..shared.gradient_capture import capture
from ..shared.resume_roles import Roles
from ..shared.trainer import TrainingSpec


def model(ctx: RankContext, cfg: dict[str, Any], model_config: Any) -> Any:
    """The seeded model on the CPU, with a noise replica's perturbation and kernel path and triage's switches."""
    built = build_causal_lm(model_config, seed=int(cfg["seed"]))
    perturbation = str(cfg.get("perturbation", ""))  # set only in the noise replicas of a recording
    apply_weight_perturbation(built, perturbation, cfg["dtype"])
    apply_kernel_path(perturbation, ctx)  # GPUs; a CPU replica's kernel path is its environment
    apply_switches(cfg, ctx)  # set by triage flips only
    return built


SPEC = TrainingSpec(model)  # the run below and its resume roles build the same trainer
ROLES = Roles("fsdp", SPEC.build)  # fsdp-resume's save and continue roles (shared/resume_roles.py)
# The rank entry of fsdp-resume's launches (the scenario's ``RESUME``): on the recording stack the continuation
# repeats the reference's last steps bit for bit, which the e2e test checks.
resume = ROLES.run


def run(ctx: RankContext) -> RunRecord:
    """Train on this rank and return what a regression moves."""
    cfg = ctx.config
    trainer = SPEC.build(ctx)
    ctx.progress("model built")
    names, params, model_config = trainer.names, trainer.params, trainer.model_config
    keep_step0, step0 = capture(names, params, ctx, 0, step0_arrays.STEP0)  # this rank's shards: merge() joins them
    step = trainer.step(ctx, inspect=keep_step0, op_trace=op_tracer(ctx, trainer.model))
    curves, observer = train_observed(ctx, step, cfg)
    # The units kept before wrapping: a failure names the unit that carried a gradient.
    results: dict[str, object] = {RESULT_KEY: trainer.units}
    if is_moe(model_config):  # how evenly the trained routers spread step 0's tokens, averaged over ranks
        try:  # a diagnostic: a transformers release whose routers it cannot find must not lose the verdict
            # every rank gets here, or every rank raised above: the same model on each
            tokens = rank_tokens(trainer.data, 0, ctx, "", trainer.device)[:, :-1]
            results["expert_load"] = mean_expert_load(trainer.model, tokens, trainer.device).cpu().tolist()
        except (RuntimeError, ValueError, LookupError) as exc:
            results["expert_load_error"] = f"{type(exc).__name__}: {exc}"
    whole = {name: p.detach().full_tensor() for name, p in zip(names, params)}  # collective: every rank gathers
    digests = {name: float_digest(w.float().cpu().numpy()) for name, w in whole.items()}
    if cfg.get(bf16_checkpoint.CONFIG_KEY) and ctx.rank == 0:  # the bf16 lane: its weights through the stack's I/O
        results[bf16_checkpoint.RESULT_KEY] = bf16_checkpoint.round_trip(whole, ctx.run_dir / "bf16-checkpoint")
    return training_record("fsdp", ctx, step, curves, observer, names, step0, digests, results)
