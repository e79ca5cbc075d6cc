"""The one FSDP2 trainer build (scenarios/shared/trainer.py) at one gloo rank: TrainingSpec composes the callables a
scenario names in one order, the module is sharded per decoder layer then the root, and ``Trainer.train`` reads the
batches a resume asks for."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pytest_gpuregress.scenarios.base import RankContext, Setup
from pytest_gpuregress.scenarios.fsdp import SCENARIO
from pytest_gpuregress.scenarios.shared.trainer import FsdpTrainer, Trainer, TrainingSpec, fully_sharded
from pytest_gpuregress.training.data import token_source
from pytest_gpuregress.training.models import build_causal_lm, load_config

pytestmark = pytest.mark.usefixtures("one_rank_group")

LAYERS = ["model.layers.0", "model.layers.1", ""]


@dataclass
class SpyData:
    """The token source, with the batches asked of it."""

    source: Any
    asked: list[int] = field(default_factory=list)

    def rank_batch(self, step: int, rank: int, world_size: int) -> np.ndarray:
        self.asked.append(step)
        return self.source.rank_batch(step, rank, world_size)


class SpyTrainer(FsdpTrainer):
    """The trainer type a spec names: build must construct this one."""


@dataclass
class Calls:
    """What a spec's callables were called with, in order."""

    seen: list[tuple[str, Any]] = field(default_factory=list)

    def spec(self) -> TrainingSpec:
        def model(ctx: RankContext, cfg: dict[str, Any], model_config: Any) -> Any:
            self.seen.append(("model", model_config.vocab_size))
            return build_causal_lm(model_config, seed=int(cfg["seed"]))

        def policy(cfg: dict[str, Any]) -> None:
            self.seen.append(("mp_policy", cfg["dtype"]))

        def data(cfg: dict[str, Any], vocab: int) -> SpyData:
            self.seen.append(("data", vocab))
            return SpyData(token_source(cfg, vocab))

        return TrainingSpec(model, mp_policy=policy, data=data, trainer=SpyTrainer)


def ctx_of(folder: Path) -> RankContext:
    cfg = {**SCENARIO.default_config(Setup("cpu", "gloo", 1, steps=8)), "global_batch": 4, "seq_len": 16}
    return RankContext(0, 1, 0, "cpu", "gloo", cfg, folder, progress_path=folder / "progress", profile=False)


def test_fully_sharded_wraps_each_layer_then_the_root_and_describes_them_unwrapped() -> None:
    """Every parameter becomes a DTensor; the table, taken before wrapping, holds each unit's parameters and its
    reduce-scatter size, fp32 at one rank: 4 bytes a parameter, the whole model between them."""
    model = build_causal_lm(load_config("tiny-llama", "cpu"), seed=0)
    names = [name for name, _ in model.named_parameters()]
    numel = sum(p.numel() for p in model.parameters())
    wrapped, table = fully_sharded(model, torch.device("cpu"), None, world_size=1)
    assert wrapped is model and list(table) == LAYERS
    assert all(hasattr(p, "to_local") for p in model.parameters())
    assert sorted(n for unit in table.values() for n in unit["params"]) == sorted(names)
    assert all(n.startswith("model.layers.1.") for n in table["model.layers.1"]["params"])
    assert sum(unit["bytes"] for unit in table.values()) == 4 * numel


def test_build_composes_the_specs_callables_in_one_order(tmp_path: Path) -> None:
    """The module, then its policy, then the data of its vocabulary; the named trainer type holding AdamW over every
    parameter at the config's rate, its schedule, the rank's place and the units."""
    calls, ctx = Calls(), ctx_of(tmp_path)
    trainer = calls.spec().build(ctx)
    assert calls.seen == [("model", 256), ("mp_policy", "fp32"), ("data", 256)]
    assert type(trainer) is SpyTrainer and isinstance(trainer.data, SpyData)
    assert trainer.names == [name for name, _ in trainer.model.named_parameters()]
    assert trainer.params == list(trainer.model.parameters())
    [group] = trainer.optimizer.param_groups
    assert group["initial_lr"] == ctx.config["lr"] and group["betas"] == tuple(ctx.config["betas"])
    assert group["fused"] is True  # fsdp's "adamw": "fused"
    assert group["lr"] == pytest.approx(ctx.config["lr"] / ctx.config["warmup_steps"])  # warm-up's first step
    assert (trainer.rank, trainer.world_size, str(trainer.device)) == (0, 1, "cpu")
    assert list(trainer.units) == LAYERS and trainer.model_config.vocab_size == 256


def test_train_reads_the_batch_a_resume_asks_for_and_steps_the_optimizer(tmp_path: Path) -> None:
    """Steps 5 and 6 of a trainer resumed at data position 2 read batches 2 and 3; two steps move every weight and
    the schedule by two; the same build gives the same weights (seeded, collective ``weights``)."""
    ctx = ctx_of(tmp_path)
    trainer = Calls().spec().build(ctx)
    # Copies: at one CPU rank the arrays share the live parameters' memory (full_tensor and numpy copy nothing).
    before = {name: values.copy() for name, values in trainer.weights().items()}
    assert before.keys() == set(trainer.names)
    assert all(np.array_equal(before[n], w) for n, w in Calls().spec().build(ctx).weights().items())
    curves = trainer.train(ctx, range(5, 7), first_batch=2, progress="resumed training")
    assert trainer.data.asked == [2, 3] and len(curves.losses) == 2
    assert trainer.scheduler.last_epoch == 2
    after = trainer.weights()
    assert all(not np.array_equal(before[n], after[n]) for n in trainer.names)
    assert (tmp_path / "progress").read_text().splitlines()[0] == "resumed training"


def test_a_trainer_without_a_step_is_refused() -> None:
    """The base Trainer names the step a scenario must give."""
    with pytest.raises(NotImplementedError):
        Trainer().step(None)  # type: ignore[arg-type]
