"""The lora run's model and trainer (scenarios/lora/trainer.py), in process at one gloo rank: the base and the adapter
built the same way every time, the trainer over the adapter alone, and training through it that reproduces the run's
losses bit for bit, in one go or continued, as the resume roles rely on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.base import RankContext
from pytest_gpuregress.scenarios.lora import checks
from pytest_gpuregress.scenarios.lora.adapter_io import to_numpy
from pytest_gpuregress.scenarios.lora.trainer import Adapted, LoraTrainer, adapted, build, build_base, distribute
from pytest_gpuregress.scenarios.shared.trainer import Trainer

from ..conftest import rank_context, tiny_lora_config

LAYERS = ("model.layers.0", "model.layers.1")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def test_the_base_is_rebuilt_identically_and_a_replica_one_ulp_away() -> None:
    """Two builds of one seed are equal bit for bit; a noise replica's base (weights one ulp up) differs in every
    weight by exactly the next float up."""
    from pytest_gpuregress.training.models import blueprint

    cfg = tiny_lora_config()
    model_config = blueprint(cfg)
    first, again = (dict(build_base(cfg, model_config, "").named_parameters()) for _ in range(2))
    assert all(np.array_equal(to_numpy(first[n]), to_numpy(again[n])) for n in first)
    up = dict(build_base(cfg, model_config, "weights_ulp_up").named_parameters())
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert np.array_equal(to_numpy(up[weight]), np.nextafter(to_numpy(first[weight]), np.float32(np.inf)))


def test_the_adapted_model_targets_every_projection_from_a_fixed_start(tmp_path: Path) -> None:
    """adapted(): every projection of both layers targeted, the base frozen, lora_B zero and lora_A from the
    counter-based seed (two builds agree, bit for bit)."""
    ctx = rank_context(tiny_lora_config(), tmp_path)
    built = adapted(ctx)
    assert isinstance(built, Adapted) and built.perturbation == ""
    assert built.targeted == [f"{layer}.{proj}" for layer in LAYERS for proj in PROJECTIONS]
    params = dict(built.peft_model.named_parameters())
    adapters = {n: p for n, p in params.items() if checks.is_adapter(n)}
    assert len(adapters) == 2 * len(built.targeted)
    assert all(p.requires_grad == checks.is_adapter(n) for n, p in params.items())
    assert all(not p.any() for n, p in adapters.items() if "lora_B" in n)
    again = dict(adapted(ctx).peft_model.named_parameters())
    assert all(p.any() and np.array_equal(to_numpy(p), to_numpy(again[n])) for n, p in adapters.items() if "lora_A" in n)


@pytest.fixture
def trainer(tmp_path: Path, one_rank_group: None) -> tuple[LoraTrainer, RankContext]:
    """The trainer rank.py trains, at step 0, under fully_shard at one rank, and its rank's context."""
    ctx = rank_context(tiny_lora_config(), tmp_path)
    return build(ctx), ctx


def test_the_trainer_trains_the_adapter_only(trainer: tuple[LoraTrainer, RankContext]) -> None:
    """Its names and params are the adapter's, in one order; the frozen weights are everything else; the optimizer
    steps the adapter; after two steps every lora_B has moved and the base has not, bit for bit."""
    lora, ctx = trainer
    assert isinstance(lora, Trainer) and lora.model is lora.wrapped.peft_model
    named = dict(lora.model.named_parameters())
    assert lora.names == [n for n in named if checks.is_adapter(n)] and len(lora.names) == 28
    assert all(p is named[n] for n, p in zip(lora.names, lora.params))
    frozen = dict(lora.frozen)
    assert set(frozen) == set(named) - set(lora.names) and not any(p.requires_grad for p in frozen.values())
    stepped = [id(p) for group in lora.optimizer.param_groups for p in group["params"]]
    assert sorted(stepped) == sorted(id(p) for p in lora.params)
    before = {n: to_numpy(p) for n, p in frozen.items()}
    curves = lora.train(ctx, range(2), 0, "train")
    assert len(curves.losses) == 2
    weights = lora.weights()
    assert set(weights) == set(lora.names) and all(np.any(w) for n, w in weights.items() if "lora_B" in n)
    assert all(np.array_equal(to_numpy(p), before[n]) for n, p in frozen.items())


def test_training_through_the_trainer_is_the_runs_training_in_one_go_or_continued(
        clean_lora_run: RunRecord, trainer: tuple[LoraTrainer, RankContext]) -> None:
    """The trainer the resume roles build trains what rank.py's run trained: its losses bit for bit, whether the
    three steps run at once or the last two continue the first; a trainer that starts at another batch does not."""
    lora, ctx = trainer
    assert lora.train(ctx, range(1), 0, "first").losses + lora.train(ctx, range(1, 3), 1, "rest").losses \
        == clean_lora_run.series["loss"]
    other = distribute(ctx, adapted(ctx))
    assert other.train(ctx, range(1), 1, "from batch 1").losses[0] != clean_lora_run.series["loss"][0]
