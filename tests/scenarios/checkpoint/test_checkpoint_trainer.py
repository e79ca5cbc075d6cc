"""The checkpoint scenario's trainer (scenarios/checkpoint/trainer.py): its data pipeline draws from every generator a
checkpoint must restore, so a resume that misses one trains on other numbers, and the record names the stream."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pytest_gpuregress.evidence.data_change import BATCH_DIGEST, STREAM_PREFIX, STREAMS
from pytest_gpuregress.scenarios.base import RankContext, Setup
from pytest_gpuregress.scenarios.checkpoint import plan, trainer
from pytest_gpuregress.training import rng_state
from pytest_gpuregress.training.data import token_source

pytestmark = pytest.mark.usefixtures("kept_generators")

GLOBAL_BATCH, SEQ_LEN = 4, 16


def config() -> dict[str, Any]:
    """The scenario's own config at one rank, with a small batch: 4 sequences of 16 tokens, 4 steps."""
    return {**plan.config(Setup("cpu", "gloo", 1)), "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "steps": 4}


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# Each generator the pipeline reads, reseeded alone; the streams it feeds (on the CPU, the device's generator is
# torch's CPU one: both torch streams move together).
RESEED: dict[str, tuple[Callable[[int], Any], set[str]]] = {
    "python": (random.seed, {"python"}),
    "numpy": (np.random.seed, {"numpy"}),
    "torch": (torch.manual_seed, {"torch_cpu", "device"}),
}


def draw(reseed: Callable[[int], Any] | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The first global batch at one rank, every generator seeded 0, then ``reseed``'s generator alone seeded 1."""
    seed_all(0)
    if reseed is not None:
        reseed(1)
    cfg = config()
    data = trainer.StochasticBatches(token_source(cfg, 256), cfg)
    inputs, labels = data.next(0, 1, torch.device("cpu"))
    assert data.position == 1
    return inputs, labels, data.streams[0]


def test_a_batch_is_cropped_and_dropped_as_configured() -> None:
    """One rank's batch: the crop shortens every row by max_crop, some labels are dropped (IGNORE), and the batch
    drawn from the same generators is the same."""
    inputs, labels, streams = draw()
    crop = int(config()["max_crop"])
    assert inputs.shape == labels.shape == (GLOBAL_BATCH, SEQ_LEN - crop)
    assert inputs.dtype == torch.int64 and int(inputs.max()) < 256
    assert 0 < int((labels == trainer.IGNORE).sum()) < labels.numel()
    assert set(streams) == set(STREAMS)
    again_inputs, again_labels, again_streams = draw()
    assert torch.equal(inputs, again_inputs) and torch.equal(labels, again_labels) and streams == again_streams


@pytest.mark.parametrize("generator", sorted(RESEED))
def test_each_generator_moves_the_batch_and_only_its_own_stream(generator: str) -> None:
    """A generator left unrestored changes the tokens trained on, and the streams' digests name that generator;
    the token source itself is untouched."""
    reseed, moved = RESEED[generator]
    inputs, labels, streams = draw()
    other_inputs, other_labels, other_streams = draw(reseed)
    assert not (torch.equal(inputs, other_inputs) and torch.equal(labels, other_labels))
    assert {name for name in streams if streams[name] != other_streams[name]} == moved


def make_ctx(folder: Path) -> RankContext:
    return RankContext(0, 1, 0, "cpu", "gloo", config(), folder, progress_path=folder / "progress", profile=False)


def two_losses(ctx: RankContext, reseed: Callable[[int], Any] | None = None) -> list[float]:
    """Steps 0 and 1 of a new trainer, every generator seeded 0 first; ``reseed``'s generator alone seeded 1 between
    the two steps (a resume that restored every generator but that one)."""
    seed_all(0)
    tr = trainer.build(ctx.config, ctx)
    first = trainer.train(tr, range(1), ctx).losses
    if reseed is not None:
        reseed(1)
    return first + trainer.train(tr, range(1, 2), ctx).losses


@pytest.fixture(scope="module")
def clean_losses(one_rank_group: None, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    states = rng_state.capture("cpu")  # set up before kept_generators: puts the generators back itself
    try:
        return two_losses(make_ctx(tmp_path_factory.mktemp("clean")))
    finally:
        rng_state.restore(states, "cpu")


def test_the_trainer_trains_through_fail_fast_and_reports_its_data(tmp_path: Path, one_rank_group: None) -> None:
    """Two steps of the FSDP2 trainer: the data position advances, step_done hears step numbers only (no metrics), a
    fail-fast stop does not end a checkpoint run, and the record's data series hold one value per step."""
    ctx = make_ctx(tmp_path)
    tr = trainer.build(ctx.config, ctx)
    assert isinstance(tr, trainer.Trainer) and tr.world_size == 1 and tr.data.position == 0
    fired: list[tuple[int, int]] = []
    ctx.step_hooks.append(lambda rank, step: fired.append((rank, step)))
    ctx.stopped = {"step": 0}  # as if fail-fast had stopped the run: the loop goes on all the same
    curves = trainer.train(tr, range(2), ctx)
    assert fired == [(0, 0), (0, 1)] and tr.data.position == 2
    assert len(curves.losses) == 2 and all(np.isfinite(curves.losses))
    assert (tmp_path / "progress").read_text().splitlines()[-2:] == ["step 0 done", "step 1 done"]
    series = trainer.data_series(tr, curves)
    assert set(series) == {BATCH_DIGEST, *(STREAM_PREFIX + name for name in STREAMS)}
    assert all(len(values) == 2 for values in series.values())
    assert series[BATCH_DIGEST] == curves.batch_digests


@pytest.mark.parametrize("generator", sorted(RESEED))
def test_a_generator_left_unrestored_changes_the_loss(tmp_path: Path, clean_losses: list[float],
                                                      generator: str) -> None:
    """Two trainers alike but for one generator reseeded before step 1: step 0's loss is the same, step 1's is not
    (other numbers, not only other digests)."""
    moved = two_losses(make_ctx(tmp_path), RESEED[generator][0])
    assert moved[0] == clean_losses[0]
    assert moved[1] != clean_losses[1]
