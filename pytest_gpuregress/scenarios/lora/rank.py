"""The lora scenario on one rank: peft LoRA training with the shared loop (training/loop.py), recording the fsdp
scenario's metrics for the adapter parameters only, then the LoRA checks (``results["lora_checks"]``)."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from ...reference.record import RunRecord, float_digest
from ..base import RankContext
from ..shared.resume_roles import Roles
from . import adapter_io, checks, dropout_check, merging, trainer, wrappers
from .trainer import build_base

FIXED_BATCH_ROWS = 2  # sequences in the batch whose logits the round trip and the merge compare
# The resume cases' rank entry (the scenario's RESUME): save and continue roles over the trainer run() trains. The
# checkpoint is what DCP's get_state_dict gives of the PeftModel (the frozen base and the adapter) and of the torch
# AdamW under accelerate's wrapper. No LoRA check runs there: a continuation is judged against the reference's last
# steps only.
resume = Roles("lora", trainer.build).run


def _sha(tensor: Any) -> str:
    return hashlib.sha256(adapter_io.to_numpy(tensor).tobytes()).hexdigest()


def run(ctx: RankContext) -> RunRecord:
    import torch

    from ...evidence.op_tracer import for_rank as op_tracer
    from ...training.data import MarkovTokens
    from ...training.loop import train_observed, training_record

    cfg = ctx.config
    built = trainer.adapted(ctx)
    initial_base = {n: _sha(p) for n, p in built.peft_model.named_parameters() if not checks.is_adapter(n)}
    base_names = list(initial_base)
    ctx.progress("model built")

    def fresh_base() -> Any:  # the round trip, the merge and the dropout check each rebuild the base
        return build_base(cfg, built.model_config, built.perturbation)

    lora = trainer.distribute(ctx, built)
    wrapped = lora.wrapped
    named = dict(wrapped.peft_model.named_parameters())
    step0: dict[str, np.ndarray] = {}
    leaked: dict[str, int] = {}

    def inspect_gradients(step: int) -> None:
        for name in base_names:  # a gradient on a frozen weight is a finding, whatever the optimizer does with it
            if name not in leaked and named[name].grad is not None:
                leaked[name] = step
        if step == 0:  # whole gradients, gathered on every rank (a collective)
            for name, p in zip(lora.names, lora.params):
                step0[f"step0_grad/{name}"] = adapter_io.to_numpy(p.grad)

    # Module paths as peft names them (base_model.model.model.layers.0...); under accelerate on the CPU the
    # collectives are DDP's (c10d::broadcast_, c10d::allreduce_ per bucket).
    step = lora.step(ctx, inspect=inspect_gradients, op_trace=op_tracer(ctx, wrapped.peft_model))
    curves, observer = train_observed(ctx, step, cfg)
    ctx.progress("lora checks")
    trained = lora.weights()  # every rank's slice, gathered
    final_base = {n: _sha(named[n]) for n in base_names}
    findings = checks.check_frozen(leaked, initial_base, final_base)
    findings += checks.check_nonzero(trained, built.targeted)
    batch = torch.from_numpy(MarkovTokens(vocab_size=built.model_config.vocab_size, seq_len=int(cfg["seq_len"]),
                                          global_batch=FIXED_BATCH_ROWS, seed=int(cfg["data_seed"]) + 1)
                             .global_batch_at(0)[:, :-1]).to(torch.device(ctx.device))
    with torch.no_grad():
        trained_logits = adapter_io.to_numpy(wrapped.model(input_ids=batch).logits.float())
    state = wrapped.state_dict_for_save()  # collective: every rank takes part
    measured: dict[str, float] = {}
    if ctx.rank == 0:
        compute_dtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
        # A base that moved in training (a frozen-base finding) is not the fresh one the reload rebuilds: the
        # reloaded logits would differ whatever the checkpoint, so only its tensors are judged then.
        base_moved = final_base != initial_base
        findings += _roundtrip(wrapped, state, trained, None if base_moved else trained_logits, fresh_base, batch,
                               compute_dtype, ctx.world_size)
        merge_findings, measured = merging.check_merge(fresh_base(), trained, cfg, batch, compute_dtype)
        findings += merge_findings + dropout_check.check_dropout(fresh_base, trained, cfg, batch)

    digests = {name: float_digest(values) for name, values in trained.items()}
    results = {"lora_checks": findings, "lora_checks_run": sorted(checks.CHECKS), "lora_measured": measured}
    return training_record("lora", ctx, step, curves, observer, lora.names, step0, digests, results)


def _roundtrip(wrapped: wrappers.Wrapped, state: dict[str, Any], trained: dict[str, np.ndarray],
               trained_logits: np.ndarray | None, fresh_base: Callable[[], Any], batch: Any, compute_dtype: Any,
               world_size: int) -> list[checks.Finding]:
    """Rank 0: save with save_pretrained, check the file, reload into a fresh base model, check tensors and logits
    (None: not judged)."""
    findings: list[checks.Finding] = []
    with tempfile.TemporaryDirectory(prefix="gpuregress-lora-") as folder:
        try:
            adapter_io.write_adapter(wrapped.peft_model, state, folder)
        except Exception as exc:  # noqa: BLE001 - a failing save is a finding, not a crash
            return [checks.finding("adapter-roundtrip", f"save_pretrained failed: {type(exc).__name__}: {exc}")]
        findings += checks.check_saved(adapter_io.read_saved(folder), trained, world_size)
        tensors_kept = not findings
        try:
            reloaded = adapter_io.reload(fresh_base(), folder)
        except Exception as exc:  # noqa: BLE001 - e.g. a size mismatch from a sliced save
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            findings.append(checks.finding("adapter-roundtrip", f"PeftModel.from_pretrained failed on the saved "
                                                                f"adapter: {type(exc).__name__}: {first}"))
            return findings
    return findings + _reloaded(wrapped, reloaded, trained, trained_logits, batch, compute_dtype, tensors_kept)


def _reloaded(wrapped: wrappers.Wrapped, reloaded: Any, trained: dict[str, np.ndarray],
              trained_logits: np.ndarray | None, batch: Any, compute_dtype: Any,
              tensors_kept: bool) -> list[checks.Finding]:
    """The reloaded model's adapter tensors bit for bit against the trained ones, then its logits (None: not judged)."""
    import torch

    reloaded_tensors = checks.check_reloaded(
        {n: adapter_io.to_numpy(p) for n, p in reloaded.named_parameters() if checks.is_adapter(n)}, trained)
    if trained_logits is None:
        return reloaded_tensors
    reloaded.to(batch.device)
    for param in reloaded.parameters():
        param.data = param.data.to(compute_dtype)
    with torch.no_grad():
        logits = adapter_io.to_numpy(reloaded(input_ids=batch).logits.float())
    # Tensors that came back bit for bit clear the checkpoint: other logits are then the two models' own code.
    kept = tensors_kept and not reloaded_tensors
    wrapper = checks.forward_replaced(wrapped.model) or checks.forward_replaced(wrapped.peft_model)
    said = "reloaded against trained" + ("" if not kept else " (every adapter tensor came back bit for bit" + (
        f"; the trained model's forward is {wrapper}, the reloaded model's its class's)" if wrapper else ")"))
    return reloaded_tensors + checks.check_logits("adapter-roundtrip", said, trained_logits, logits, 0.0,
                                                  tensors_kept=kept, trained_forward=wrapper)
