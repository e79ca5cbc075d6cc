"""The checkpoint scenario on one rank: what each launch does, by its ``role``.

Roles ``main``, ``resume-first``, ``resume-second``, ``sharded-save``, ``sharded-load``, ``portability``
(docs/checkpoint.md). A problem with a checkpoint is a finding in the record, never an exception: the
verdict names it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import GpuRegressError
from ...reference.record import RunRecord, float_digest
from ...training import rng_state as rng
from ...training import state_digests
from ...training.state_digests import full_tensors, sha, to_numpy
from ..base import RankContext
from . import checks, files, full_state, plan, portable, trainer, trainer_io

SCRAMBLE_SEED = 987_654_321  # generators before a load: a value no run seeds with


def _record(ctx: RankContext, **fields: Any) -> RunRecord:
    results = fields.pop("results", {})
    results["pid"] = {str(ctx.rank): os.getpid()}
    return RunRecord(scenario=plan.NAME, config=plan.stored(ctx.config), platform_key="", world_size=ctx.world_size,
                     results=results, **fields)


def shared_folder(ctx: RankContext, prefix: str) -> Path:
    """A new folder under the configured root, made by rank 0 and named to every rank (a broadcast)."""
    import torch
    import torch.distributed as dist

    root = Path(ctx.config["root"])
    device = torch.device(ctx.device)  # NCCL broadcasts device tensors only
    data = b""
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        data = tempfile.mkdtemp(prefix=prefix, dir=root).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if ctx.rank == 0:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return Path(bytes(buffer.cpu().numpy()).decode())


# --- main ------------------------------------------------------------------------------------------------


def _roundtrip(ctx: RankContext, tr: trainer.Trainer, model: dict[str, Any], with_bundle: bool) -> dict[str, Any]:
    """Gather, save, reload and check (rank 0); with the bundle for the portability case when asked.
    ``model``: the config fields of the model ``tr`` trains."""
    import torch

    from ...training.models import blueprint, describe_model

    trained = {name: to_numpy(p) for name, p in zip(tr.names, tr.params)}  # every rank's shard: collective
    trained_logits = full_state.logits_of(tr.model, tr.device, tr.data.source.vocab_size)  # collective
    gathered = full_state.gather(tr.model)  # collective
    if ctx.rank != 0:
        return {}
    model_config, label = blueprint(model), describe_model(model)
    out: dict[str, Any] = {"ran": True}
    Path(ctx.config["root"]).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpuregress-full-state-", dir=ctx.config["root"]) as folder:
        out["findings"], logits = full_state.roundtrip(gathered, trained, trained_logits, model_config, label,
                                                       Path(folder), torch.device(ctx.device))
        if with_bundle and logits is not None:  # the reload above read this file: it cannot fail now
            saved = Path(folder) / "model.safetensors"
            evaluation = portable.evaluate(files.read(saved), model_config, label, ctx.device)
            out["bundle"] = {**evaluation.summary(), "model": model["model"]}
            # the file the stack wrote, as the stack reads it; the round trip has checked it equals ``trained``
            out["bundle_arrays"] = {"logits": evaluation.logits, **full_state.saved_arrays(saved)}
            out["findings"] += [f"the saved checkpoint on {ctx.device}: {p}" for p in evaluation.problems]
    return out


def run_main(ctx: RankContext) -> RunRecord:
    import torch

    cfg = ctx.config
    k, steps = plan.resume_at(cfg), int(cfg["steps"])
    tr = trainer.build(cfg, ctx)
    ctx.progress("model built")
    first = trainer.train(tr, range(k), ctx)
    boundary = state_digests.boundary(tr, tr.data.position, ctx.device_kind, ctx.rank)
    rest = trainer.train(tr, range(k, steps), ctx)
    series = {"loss": first.losses + rest.losses, "grad_norm": first.grad_norms + rest.grad_norms,
              **trainer.data_series(tr, first, rest)}
    ctx.progress("full state dict")
    main = _roundtrip(ctx, tr, cfg, with_bundle=True)
    tied_out: dict[str, Any] = {}
    if cfg.get("tied_model"):  # the tiny Llama's launch only; a user's model has no tied twin
        ctx.progress("tied model")
        tied_cfg = plan.tied_fields(cfg)
        tied = trainer.build(tied_cfg, ctx)
        trainer.train(tied, range(k), ctx)
        tied_out = _roundtrip(ctx, tied, tied_cfg, with_bundle=False)
    arrays = main.pop("bundle_arrays", {})
    digests = {n[len(files.BUNDLE_PREFIX):]: float_digest(v) for n, v in arrays.items() if n.startswith(files.BUNDLE_PREFIX)}
    # Strict deterministic algorithms (the CPU): only then must a resumed curve be bitwise equal.
    deterministic = torch.are_deterministic_algorithms_enabled() and \
        not torch.is_deterministic_algorithms_warn_only_enabled()
    return _record(ctx, series=series, arrays=arrays, param_names=list(tr.names), digests=digests,
                   results={"boundary": boundary, "full_state_dict": main, "tied": tied_out,
                            "deterministic": deterministic})


# --- resume ----------------------------------------------------------------------------------------------


def train_and_save(ctx: RankContext, prefix: str) -> tuple[trainer.Trainer, list[float], Path]:
    """A new trainer, its first k steps (losses) and its save into a new shared folder; a save that raises leaves
    no folder behind (the session never learns its name)."""
    k = plan.resume_at(ctx.config)
    tr = trainer.build(ctx.config, ctx)
    losses = trainer.train(tr, range(k), ctx).losses
    folder = shared_folder(ctx, prefix)
    ctx.progress("saving")
    try:
        trainer_io.save(tr, folder, k, ctx.device_kind)
    except BaseException:
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return tr, losses, folder


def run_resume_first(ctx: RankContext) -> RunRecord:
    tr, losses, folder = train_and_save(ctx, "gpuregress-resume-")
    # after the save: a save that changes state shows
    boundary = state_digests.boundary(tr, tr.data.position, ctx.device_kind, ctx.rank)
    return _record(ctx, series={"loss": losses}, results={"folder": str(folder), "boundary": boundary})


def _loaded(ctx: RankContext, with_rng: bool) -> trainer.Trainer | RunRecord:
    """A new trainer, its generators scrambled, loaded from the launch's folder; the record of the load's error
    where it failed."""
    tr = trainer.build(ctx.config, ctx)
    rng.scramble(SCRAMBLE_SEED + ctx.rank, ctx.device_kind)
    ctx.progress("loading")
    try:
        trainer_io.load(tr, Path(ctx.config["folder"]), with_rng=with_rng, device_kind=ctx.device_kind)
    except GpuRegressError as exc:
        return _record(ctx, results={"load_error": str(exc)})
    return tr


def run_resume_second(ctx: RankContext) -> RunRecord:
    k, steps = plan.resume_at(ctx.config), int(ctx.config["steps"])
    tr = _loaded(ctx, with_rng=True)
    if isinstance(tr, RunRecord):
        return tr
    boundary = state_digests.boundary(tr, tr.data.position, ctx.device_kind, ctx.rank)  # what step k is about to see
    losses = trainer.train(tr, range(k, steps), ctx).losses
    return _record(ctx, series={"loss": losses}, results={"boundary": boundary})


# --- sharded ---------------------------------------------------------------------------------------------


def chunk_hashes(values: np.ndarray, chunks: int) -> list[str]:
    """sha256 of each of ``chunks`` pieces along dim 0, cut as FSDP2 cuts shards (torch.chunk)."""
    if values.ndim == 0 or chunks <= 1:
        return [sha(values)]
    size = -(-values.shape[0] // chunks)
    return [sha(values[i : i + size]) for i in range(0, values.shape[0], size)]


def tensor_hashes(tr: trainer.Trainer, cfg: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """piece -> parameter -> {sha256, shape, chunks}: what a reshard must preserve, whole tensors gathered so they
    do not depend on the world size. Collective."""
    chunks = max(int(cfg["saved_world"]), int(cfg["load_world"]))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for piece, name, values in full_tensors(tr):
        out.setdefault(piece, {})[name] = {"sha256": sha(values), "shape": list(values.shape),
                                           "chunks": chunk_hashes(values, chunks)}
    return out


def run_sharded_save(ctx: RankContext) -> RunRecord:
    tr, _, folder = train_and_save(ctx, "gpuregress-sharded-")
    return _record(ctx, results={"folder": str(folder), "hashes": tensor_hashes(tr, ctx.config)})


def run_sharded_load(ctx: RankContext) -> RunRecord:
    # Generators are per rank: at another world size there is no rank to give them to.
    tr = _loaded(ctx, with_rng=False)
    if isinstance(tr, RunRecord):
        return tr
    return _record(ctx, results={"hashes": tensor_hashes(tr, ctx.config)})


# --- portability -----------------------------------------------------------------------------------------


def run_portability(ctx: RankContext) -> RunRecord:
    from ...training.models import architecture_of, blueprint, describe_model

    if ctx.rank != 0:  # rank 0 evaluates; the group is the session's usual one (warm, and possible under torchrun)
        return _record(ctx)
    bundle = Path(ctx.config["bundle"])
    out: dict[str, Any] = {"bundle": str(bundle), "ran": True}
    arrays = {}
    try:
        reference = checks.read_bundle(bundle)
        recorded = reference.config
        try:
            now, label = architecture_of(recorded), describe_model(recorded)
        except (OSError, ValueError) as exc:  # a user's model whose config file is not on this machine
            raise GpuRegressError(f"{bundle}: the model it was recorded for cannot be built here: {exc}") from None
        if now != recorded.get("model_architecture"):
            raise GpuRegressError(f"{bundle}: a checkpoint for another architecture: recorded for {recorded['model']} "
                                  f"({recorded['model_size']}) with architecture {recorded.get('model_architecture')}, "
                                  f"and {label} now gives {now}\n"
                                  "  fix: record the bundle again (pytest --gpuregress --gpuregress-record "
                                  "'gpuregress::checkpoint*')")
        evaluation = portable.evaluate(files.read(bundle), blueprint(recorded), label, ctx.device)
        exact = checks.same_numerics(reference.fingerprint, ctx.fingerprint)
        expected = reference.results["full_state_dict"]["bundle"]
        out.update(evaluation.summary(), lane="exact" if exact else "tolerant",
                   deviation_from_bundle=portable.deviation_between(evaluation.logits, reference.arrays["logits"]),
                   recorded_on=checks.describe_stack(reference.fingerprint))
        out["findings"] = evaluation.problems + portable.compare(evaluation.summary(), evaluation.logits, expected,
                                                                 reference.arrays["logits"], exact)
        arrays["logits"] = evaluation.logits
    except GpuRegressError as exc:
        out["findings"] = [str(exc)]
    return _record(ctx, arrays=arrays, results={"portability": out})


ROLES: dict[str, Callable[[RankContext], RunRecord]] = {
    "main": run_main, "resume-first": run_resume_first, "resume-second": run_resume_second,
    "sharded-save": run_sharded_save, "sharded-load": run_sharded_load, "portability": run_portability,
}


def run(ctx: RankContext) -> RunRecord:
    return ROLES[ctx.config["role"]](ctx)
