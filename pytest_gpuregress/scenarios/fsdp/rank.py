"""The fsdp scenario on one rank: FSDP2 training of a tiny Llama, recording what a regression moves.

Each decoder layer and the root are wrapped with ``fully_shard``; AdamW with linear warm-up and
cosine decay, gradient clipping. fp32 on the CPU; bf16 parameters with fp32 gradient reduction
on GPUs. Per step the record keeps the global loss, the global gradient norm and every
parameter's gradient norm; at step 0 the full gradients; at the end digests of every parameter.
Step-0 gradients are the sharpest signal: a corrupted reduce-scatter shows there element by
element long before the loss curve moves (see docs/faults.md, section 1).
"""

from __future__ import annotations

import numpy as np

from ...reference import step0 as step0_arrays
from ...reference.record import RunRecord, float_digest
from ...training.observe import StepObserver
from ...training.schedule import lr_factor
from ..base import RankContext


def run(ctx: RankContext) -> RunRecord:
    """Train on this rank and return what a regression moves."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ...training.data import token_source
    from ...training.models import blueprint, build_causal_lm
    from ...training.moe import expert_load, is_moe
    from ...training.noise import apply_kernel_path, apply_weight_perturbation
    from ...training.shard_units import RESULT_KEY, describe_units, shard_units
    from ...training.step import next_token_loss, rank_tokens
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

    mp_policy = MixedPrecisionPolicy()
    if cfg["dtype"] == "bf16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = shard_units(model)  # each decoder layer, then the root
    # Kept before wrapping, which replaces the parameters: a failure names the unit that carried a gradient.
    unit_table = describe_units(model, units, ctx.world_size)
    for _path, unit in units:
        fully_shard(unit, mp_policy=mp_policy)

    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    opt = torch.optim.AdamW(
        params,
        lr=float(cfg["lr"]),
        betas=tuple(cfg["betas"]),
        eps=float(cfg["eps"]),
        weight_decay=float(cfg["weight_decay"]),
        foreach=False,
    )
    steps = int(cfg["steps"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, steps, int(cfg["warmup_steps"]), float(cfg["min_lr_ratio"]))
    )
    data = token_source(cfg, model_config.vocab_size)

    losses: list[float] = []
    grad_norms: list[float] = []
    param_norms = np.zeros((steps, len(params)), dtype=np.float64)
    step0: dict[str, np.ndarray] = {}
    observer = StepObserver(ctx, steps, tokens_per_step=int(cfg["global_batch"]) * int(cfg["seq_len"]))
    ctx.progress("training")
    for step in range(steps):
        with observer.step(step):
            loss = next_token_loss(model, rank_tokens(data, step, ctx, perturbation, device))
            loss.backward()
            # A parameter the loss does not use (a user's model may have one) has no gradient: zero, as AdamW sees it.
            grads = [p.grad.to_local() if p.grad is not None else torch.zeros_like(p.to_local()) for p in params]
            # One float64 all-reduce per step carries the loss and every parameter's squared norm.
            stats = torch.stack([loss.detach().double()] + [g.double().pow(2).sum() for g in grads])
            if step == 0:
                for name, p, g in zip(names, params, grads):  # this rank's shard only: merge() assembles the tensors
                    step0.update(step0_arrays.shard_arrays(name, g.float().cpu().numpy(), tuple(p.shape),
                                                           ctx.rank, ctx.world_size, step0_arrays.full_max_of(cfg)))
            total = torch.nn.utils.clip_grad_norm_(params, float(cfg["grad_clip"]))
            total = total.full_tensor() if hasattr(total, "full_tensor") else total
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(stats)
            stats = stats.cpu()
            losses.append(float(stats[0]) / ctx.world_size)
            grad_norms.append(float(total.double()))
            param_norms[step] = stats[1:].sqrt().numpy()
        if ctx.step_done(step, loss=losses[-1], grad_norm=grad_norms[-1]):
            break

    observer.finish(ctx.world_size)
    results = observer.results()
    results[RESULT_KEY] = unit_table
    if is_moe(model_config):  # how evenly the trained routers spread step 0's tokens, averaged over ranks
        try:  # a diagnostic: a transformers release whose routers it cannot find must not lose the verdict
            load = torch.from_numpy(expert_load(model, rank_tokens(data, 0, ctx, "", device)[:, :-1]))
            dist.all_reduce(load)  # every rank gets here, or every rank raised above: the same model on each
            results["expert_load"] = (load / ctx.world_size).tolist()
        except (RuntimeError, ValueError, LookupError) as exc:
            results["expert_load_error"] = f"{type(exc).__name__}: {exc}"
    digests = {}
    for name, p in zip(names, params):
        digests[name] = float_digest(p.detach().full_tensor().float().cpu().numpy())
    return RunRecord(
        scenario="fsdp",
        config=dict(cfg),
        platform_key="",  # set by the plugin, which knows the platform
        world_size=ctx.world_size,
        series={"loss": losses, "grad_norm": grad_norms},
        param_names=names,
        arrays={"param_grad_norm": param_norms[: len(losses)], **step0},
        digests=digests,
        results=results,
        timings=observer.timings(),
    )
