"""The checkpoint scenario's cases, configuration and launches. Session side, torch-free.

Each launch adds its ``role`` and folders to the one configuration; those keys are ``SESSION_ONLY``, kept out
of the stored config, so a reference compares with any selection of cases and any temporary folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ... import activities as act
from ...resources import shipped_dir
from ..base import Case, Launch, Setup
from ..shared.exercised import runs_llama_code, ties_embeddings, trained

NAME = "checkpoint"
REFERENCE = "checkpoint"  # the full-state-dict case's reference: the trained model's checkpoint and logits
MODEL = "tiny-llama"
TIED_MODEL = "tiny-llama-tied"
# The portability case loads this bundle by default: the shipped reference recorded on the CPU, so
# on a GPU it is a checkpoint made on another platform, which is the point of the case.
SHIPPED_PLATFORM = "cpu-gloo-w2-fp32"
DEFAULT_STEPS = 10  # 2k: the resume case saves after k = 5
MAIN_PARTS = ("full_state_dict", "tied")  # the cases the main launch carries
SESSION_ONLY = ("role", "root", "folder", "saved_world", "load_world", "bundle")

# The CPU size on every device: checkpoint logic does not need model scale, the shipped checkpoint
# stays small (0.5 MB), and fp32 keeps a round trip's equalities exact on GPUs too.
COMMON: dict[str, Any] = {
    "model": MODEL, "tied_model": TIED_MODEL, "model_size": "cpu", "dtype": "fp32",
    "steps": DEFAULT_STEPS, "seed": 0, "data_seed": 1234, "global_batch": 16, "seq_len": 64,
    "lr": 3e-3, "warmup_steps": 2, "min_lr_ratio": 0.1, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8,
    "grad_clip": 1.0,
    # The data pipeline consumes every RNG, so a generator left unrestored moves the resumed curve:
    # rows shuffled (Python), a random crop (numpy), input tokens replaced (torch CPU), labels
    # dropped (torch on the device).
    "token_dropout": 0.05, "label_dropout": 0.1, "max_crop": 3,
}


def config(setup: Setup, model: str | None = None) -> dict[str, Any]:
    """What every rank runs with; stored with the reference (less the session-only keys).

    ``model``: a user's model (--gpuregress-model, by name) in place of the tiny Llama, with no tied model."""
    from ...training.models import architecture_of
    from ...training.token_file import describe_for

    cfg = dict(COMMON)
    if setup.steps is not None:
        cfg["steps"] = max(2, int(setup.steps))
    if model is not None:
        del cfg["tied_model"]
        cfg.update(setup.model(model).config_fields())
    cfg["model_architecture"] = architecture_of(cfg)
    if model is None:
        cfg["tied_model_architecture"] = architecture_of(tied_fields(cfg))
    # A user's token sample replaces the synthetic data of the user's models only (training_config.py).
    tokens = describe_for(cfg, setup.tokens if model is not None else None)
    if tokens is not None:
        cfg["tokens"] = tokens
    return cfg


def tied_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the tied model in place of the main one (its identity fields), for trainer.build."""
    return {**{k: v for k, v in cfg.items() if k not in ("model_file", "model_factory")}, "model": cfg["tied_model"]}


def stored(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in SESSION_ONLY}


def resume_at(config: dict[str, Any]) -> int:
    """k: the step count after which the resume case saves; the run goes 2k steps in all."""
    return int(config["steps"]) // 2


def reshard_pairs(world_size: int) -> list[tuple[int, int]]:
    """(save world, load world): N -> 1 and 1 -> N, and N -> N/2 where there are four ranks or more."""
    if world_size < 2:
        return []
    pairs = [(world_size, 1), (1, world_size)]
    if world_size >= 4:
        pairs.append((world_size, world_size // 2))
    return pairs


def cases(setup: Setup) -> list[Case]:
    out = [Case("full-state-dict", launch="main", data={"part": "full_state_dict"}, exercises=_round_trip(setup)),
           Case("tied", launch="main", data={"part": "tied"}, exercises=_round_trip(setup))]
    # At one rank the 2-rank pairs are listed anyway: skipped with the reason, not silently absent.
    out += [Case(f"sharded-{n}to{m}", launch=f"sharded-{n}to{m}", data={"part": "sharded", "save": n, "load": m},
                 min_ranks=2, exercises=_resharded(setup, n))
            for n, m in reshard_pairs(max(setup.world_size, 2))]
    out.append(Case("resume", launch="resume", data={"part": "resume"}, exercises=_round_trip(
        setup, act.OPTIMIZER_STATE_LOAD, act.RESUME_RESTORE)))
    out.append(Case("portability", launch="portability", data={"part": "portability"}, exercises=act.exercises(
        act.FORWARD, act.LLAMA_FORWARD, act.CHECKPOINT_READ,
        summary="inference from the shipped bundle on 1 rank: no optimizer step, no collective")))
    # Each model of --gpuregress-model: the round trip (with a reference of its own), resharding and resume.
    for spec in setup.models:
        out += [Case(f"{c.id}-{spec.name}", launch=f"{c.launch}-{spec.name}", data={**c.data, "model": spec.name},
                     min_ranks=c.min_ranks, exercises=_of_model(setup, c, spec.name), family=f"checkpoint-{c.id}")
                for c in out if c.data["part"] in ("full_state_dict", "sharded", "resume") and "model" not in c.data]
    return out


def _of_model(setup: Setup, case: Case, model: str) -> act.Exercises:
    """The tiny Llama's case for a user's model: its own code, and tied weights only where its config ties them
    (no tied model rides along: config() drops it)."""
    assert case.exercises is not None
    saves_tied = act.TIED_SAVE in case.exercises.does and ties_embeddings(setup, model)  # its full state dict's
    does = set(case.exercises.does) - {act.LLAMA_FORWARD, act.TIED_SAVE}
    does |= {act.LLAMA_FORWARD} if runs_llama_code(setup, model) else set()
    does |= {act.TIED_SAVE} if saves_tied else set()
    return act.Exercises(frozenset(does), case.exercises.summary, case.exercises.absent)


def _round_trip(setup: Setup, *more: str) -> act.Exercises:
    """Trained on this run's ranks with AdamW's single-tensor step, no clipping, fp32 on every device, on batches
    that draw from every random stream; the full state dict gathered, saved and loaded, with the tied model's
    beside it."""
    return trained(setup, adamw="single", clips=False, bf16=False,
                   more=(act.FULL_STATE_DICT, act.TIED_SAVE, act.CHECKPOINT_READ, act.RANDOM_STREAMS, *more))


def _resharded(setup: Setup, saved_on: int) -> act.Exercises:
    """Trained and saved on ``saved_on`` ranks, loaded at another world size."""
    alone = saved_on < 2
    return trained(setup, adamw="single", clips=False, bf16=False, collectives=() if alone else (act.ANY,),
                   more=(act.OPTIMIZER_STATE_LOAD, act.SHARDED_LOAD, act.CHECKPOINT_READ, act.RANDOM_STREAMS,
                         *(() if alone else (act.FULL_STATE_DICT,))),
                   summary="it trains and saves on 1 rank, then only loads on 2" if alone else "")


def main_launch(setup: Setup, root: str, model: str | None = None) -> Launch:
    """The straight run: 2k steps, state digests at step k, then the full-state-dict round trip, and for the tiny
    Llama the tied model's."""
    return Launch("main" if model is None else f"main-{model}", {**config(setup, model), "role": "main", "root": root})


def portability_launch(setup: Setup, root: str, bundle: str | None) -> Launch:
    # Rank 0 evaluates, with no collective: the numbers cannot depend on the world size.
    return Launch("portability", {**config(setup), "role": "portability", "root": root,
                                  "bundle": bundle or str(shipped_bundle())})


def resume_launches(setup: Setup, root: str, folder: str | None = None,
                    model: str | None = None) -> tuple[Launch, Launch]:
    """k steps and a save; then, in new processes (never pooled ones), a load from ``folder`` and k more steps."""
    base = {**config(setup, model), "root": root}
    suffix = "" if model is None else f"-{model}"
    return (Launch(f"resume-first{suffix}", {**base, "role": "resume-first"}),
            Launch(f"resume-second{suffix}", {**base, "role": "resume-second", "folder": folder or ""}, fresh_ranks=True))


def reshard_launches(case: Case, setup: Setup, root: str, folder: str | None = None) -> tuple[Launch, Launch]:
    """Train and save with DCP at the save world size; load into a fresh model at the load world size."""
    n, m = int(case.data["save"]), int(case.data["load"])
    base = {**config(setup, case.data.get("model")), "root": root, "saved_world": n, "load_world": m}
    return (Launch(f"{case.id}-save", {**base, "role": "sharded-save"}, world_size=n),
            Launch(f"{case.id}-load", {**base, "role": "sharded-load", "folder": folder or ""}, world_size=m))


def shipped_bundle() -> Path:
    return shipped_dir("reference_runs") / REFERENCE / SHIPPED_PLATFORM
