"""The fsdp scenario on one rank: FSDP2 training of a tiny Llama, recording what a regression moves.

Each decoder layer and the root are wrapped with ``fully_shard``; AdamW with linear warm-up and
cosine decay, gradient clipping. fp32 on the CPU; bf16 parameters with fp32 gradient reduction
on GPUs. Per step the record keeps the global loss, the global gradient norm and every
parameter's gradient norm; at step 0 the full gradients; at the end digests of every parameter.
Step-0 gradients are the sharpest signal: a corrupted reduce-scatter shows there element by
element long before the loss curve moves (see docs/faults.md, section 1).
"""

from __future__ import annotations

from ...reference import step0 as step0_arrays
from ...reference.record import RunRecord, float_digest
from ...training import bf16_checkpoint
from ...training.optimizer import AdamWSettings, Optimization, Schedule, adamw
from ..base import RankContext
from ..shared.gradient_capture import capture


def run(ctx: RankContext) -> RunRecord:
    """Train on this rank and return what a regression moves."""
    import torch

    from ...training.data import token_source
    from ...training.fsdp2 import RESULT_KEY, describe_units, mixed_precision, reduce_dtype_of, shard, shard_units
    from ...training.loop import TrainStep, clip_gradients, train_observed, training_record
    from ...training.models import blueprint, build_causal_lm
    from ...training.moe import is_moe, mean_expert_load
    from ...training.noise import apply_kernel_path, apply_weight_perturbation
    from ...training.op_trace import for_rank as op_tracer
    from ...training.step import rank_tokens, step_loss
    from ...training.switches import apply_switches

    cfg = ctx.config
    device = torch.device(ctx.device)
    model_config = blueprint(cfg)
    model = build_causal_lm(model_config, seed=int(cfg["seed"]))
    perturbation = str(cfg.get("perturbation", ""))  # set only in the noise replicas of a recording
    apply_weight_perturbation(model, perturbation, cfg["dtype"])
    apply_kernel_path(perturbation, ctx)
    apply_switches(cfg, ctx)  # set by triage flips only
    model = model.to(device)
    ctx.progress("model built")

    units = shard_units(model)  # each decoder layer, then the root
    # Kept before wrapping, which replaces the parameters: a failure names the unit that carried a gradient.
    unit_table = describe_units(model, units, ctx.world_size, reduce_dtype_of(cfg))
    shard(units, mp_policy=mixed_precision(cfg))

    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    data = token_source(cfg, model_config.vocab_size)
    keep_step0, step0 = capture(names, params, ctx, 0, step0_arrays.STEP0)  # this rank's shards: merge() joins them

    step = TrainStep(
        loss=lambda s: step_loss(model, data, s, ctx, perturbation, device),
        optimization=Optimization.of(adamw(params, AdamWSettings.from_config(cfg)), Schedule.from_config(cfg)),
        clip=lambda: clip_gradients(params, float(cfg["grad_clip"])),
        tracked=params,
        inspect=keep_step0,
        op_trace=op_tracer(ctx, model),
    )
    curves, observer = train_observed(ctx, step, cfg)
    results: dict[str, object] = {RESULT_KEY: unit_table}
    if is_moe(model_config):  # how evenly the trained routers spread step 0's tokens, averaged over ranks
        try:  # a diagnostic: a transformers release whose routers it cannot find must not lose the verdict
            # every rank gets here, or every rank raised above: the same model on each
            results["expert_load"] = mean_expert_load(model, rank_tokens(data, 0, ctx, "", device)[:, :-1], device).cpu().tolist()
        except (RuntimeError, ValueError, LookupError) as exc:
            results["expert_load_error"] = f"{type(exc).__name__}: {exc}"
    whole = {name: p.detach().full_tensor() for name, p in zip(names, params)}  # collective: every rank gathers
    digests = {name: float_digest(w.float().cpu().numpy()) for name, w in whole.items()}
    if cfg.get(bf16_checkpoint.CONFIG_KEY) and ctx.rank == 0:  # the bf16 lane: its weights through the stack's I/O
        results[bf16_checkpoint.RESULT_KEY] = bf16_checkpoint.round_trip(whole, ctx.run_dir / "bf16-checkpoint")
    return training_record("fsdp", ctx, step, curves, observer, names, step0, digests, results)
