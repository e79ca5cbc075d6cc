"""A checkpoint-scenario trainer's whole state saved and restored (scenarios/checkpoint/trainer_io.py), at one gloo
rank: the restored state digests as the saved one piece by piece and trains on to the same losses; a checkpoint
bug injected at a fault point shows as exactly the pieces it lost, and an incomplete folder is refused by name."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_gpuregress.errors import CheckpointProblem
from pytest_gpuregress.fault_points import intercepted
from pytest_gpuregress.faults import install_counted
from pytest_gpuregress.scenarios.base import RankContext, Setup
from pytest_gpuregress.scenarios.checkpoint import plan, sharded, trainer, trainer_io
from pytest_gpuregress.training import rng_state, state_digests
from pytest_gpuregress.training.resume_checkpoint import read_meta

pytestmark = pytest.mark.usefixtures("kept_generators")

SAVED_AT = 2  # steps before the save; the run goes on to STEPS
STEPS = 3
NUDGED = "model.layers.1.self_attn.q_proj.weight"  # the ulp_nudge fault's default target
RNG_PIECES = {("rng.python", "rank0"), ("rng.numpy", "rank0"), ("rng.torch_cpu", "rank0")}
Digests = dict[str, dict[str, str]]


@dataclass(frozen=True)
class Saved:
    folder: Path
    boundary: Digests  # the saving trainer's state right after the save
    continued: list[float]  # its losses of the steps after the save


def make_ctx(folder: Path) -> RankContext:
    cfg = {**plan.config(Setup("cpu", "gloo", 1)), "global_batch": 4, "seq_len": 16, "steps": STEPS}
    return RankContext(0, 1, 0, "cpu", "gloo", cfg, folder, profile=False)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> RankContext:
    return make_ctx(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def saved(one_rank_group: None, ctx: RankContext, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """Train SAVED_AT steps, save, digest the state, train on: once for the module (its generators put back)."""
    states = rng_state.capture("cpu")
    try:
        tr = trainer.build(ctx.config, ctx)
        trainer.train(tr, range(SAVED_AT), ctx)
        folder = tmp_path_factory.mktemp("saved") / "ckpt"
        trainer_io.save(tr, folder, SAVED_AT, "cpu")
        boundary = state_digests.boundary(tr, tr.data.position, "cpu", 0)
        continued = trainer.train(tr, range(SAVED_AT, STEPS), ctx).losses
    finally:
        rng_state.restore(states, "cpu")
    return Saved(folder, boundary, continued)


@pytest.fixture
def folder(saved: Saved, tmp_path: Path) -> Path:
    """A private copy of the saved checkpoint, for a test that damages it."""
    return Path(shutil.copytree(saved.folder, tmp_path / "ckpt"))


def fresh(ctx: RankContext) -> trainer.Trainer:
    """A new trainer at step 0, its generators scrambled as the resume role scrambles them before a load."""
    tr = trainer.build(ctx.config, ctx)
    rng_state.scramble(123_456_789, "cpu")
    return tr


def differing(saved: Digests, loaded: Digests) -> set[tuple[str, str]]:
    """(piece, item) of every digest the loaded state does not share with the saved one."""
    return {(piece, item) for piece, items in saved.items() for item, digest in items.items()
            if loaded.get(piece, {}).get(item) != digest}


def test_the_folder_holds_tensors_generators_and_trainer_json_last(saved: Saved) -> None:
    """The layout: DCP's tensors, this rank's generators, trainer.json with the step, world size and data position."""
    assert sorted(p.name for p in saved.folder.iterdir()) == ["rng-rank0.json", trainer_io.TENSORS, trainer_io.TRAINER_JSON]
    sharded.verify(saved.folder / trainer_io.TENSORS)
    meta = read_meta(saved.folder, trainer_io.FORMAT)
    assert (meta["step"], meta["world_size"], meta["data_position"]) == (SAVED_AT, 1, SAVED_AT)
    assert meta["scheduler"]["last_epoch"] == SAVED_AT


def test_a_load_restores_every_piece_and_the_run_goes_on_bit_for_bit(saved: Saved, ctx: RankContext) -> None:
    """Weights, both moments, the step, param groups, schedule, data position and every generator digest as saved,
    and the steps after the save give the saving run's losses exactly."""
    tr = fresh(ctx)
    meta = trainer_io.load(tr, saved.folder, with_rng=True, device_kind="cpu")
    assert meta["step"] == SAVED_AT and tr.data.position == SAVED_AT
    assert differing(saved.boundary, state_digests.boundary(tr, tr.data.position, "cpu", 0)) == set()
    assert trainer.train(tr, range(SAVED_AT, STEPS), ctx).losses == saved.continued


def test_without_generators_only_the_generators_differ_and_their_file_is_not_read(folder: Path,
                                                                                   saved: Saved,
                                                                                   ctx: RankContext) -> None:
    """with_rng=False (a load at another world size): every piece but the generators restored; no rng file needed."""
    trainer_io.rng_file(folder, 0).unlink()
    tr = fresh(ctx)
    trainer_io.load(tr, folder, with_rng=False, device_kind="cpu")
    assert differing(saved.boundary, state_digests.boundary(tr, tr.data.position, "cpu", 0)) == RNG_PIECES


@pytest.mark.parametrize(("fault", "lost"), [
    ("checkpoint:mode=ulp_nudge", {("model", NUDGED)}),
    ("checkpoint:mode=rng_not_restored", RNG_PIECES),
    ("checkpoint:mode=optimizer_dropped", None),  # checked below: every optimizer piece, no weight
])
def test_a_checkpoint_bug_at_a_fault_point_shows_as_the_pieces_it_lost(saved: Saved, ctx: RankContext, fault: str,
                                                                       lost: set[tuple[str, str]] | None) -> None:
    """The faults of docs/faults.md section 3 that act on this load path: each fires, and the state digests name
    exactly what it changed."""
    tr = fresh(ctx)
    on_rank = SimpleNamespace(rank=0, cleanup_hooks=[])  # what an installer needs of the rank: its undo list
    [firing] = install_counted([fault], on_rank)
    try:
        trainer_io.load(tr, saved.folder, with_rng=True, device_kind="cpu")
    finally:
        for undo in reversed(on_rank.cleanup_hooks):
            undo()
    assert firing.count >= 1 and intercepted() == []
    changed = differing(saved.boundary, state_digests.boundary(tr, tr.data.position, "cpu", 0))
    if lost is not None:
        assert changed == lost
    else:
        pieces = {piece for piece, _ in changed}
        assert {"optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.step"} <= pieces
        assert not pieces & {"model", "data.position", "lr_scheduler", *(piece for piece, _ in RNG_PIECES)}
        assert {name for piece, name in changed if piece == "optimizer.exp_avg"} == set(tr.names)


@pytest.mark.parametrize(("damage", "problem"), [
    ("trainer.json", "missing"),
    ("format", "format 'gpuregress-trainer-checkpoint/0'"),
    ("generators", "missing"),
    ("shard", "missing"),
])
def test_an_incomplete_checkpoint_is_refused_naming_the_file(folder: Path, ctx: RankContext, damage: str,
                                                             problem: str) -> None:
    """trainer.json gone or of another format, this rank's generators gone, a DCP shard gone: a CheckpointProblem
    naming that file, whose fix is to save again."""
    meta = folder / trainer_io.TRAINER_JSON
    shard = next(p for p in (folder / trainer_io.TENSORS).iterdir() if p.name != sharded.METADATA)
    target = {"trainer.json": meta, "format": meta, "generators": trainer_io.rng_file(folder, 0), "shard": shard}[damage]
    if damage == "format":
        meta.write_text(meta.read_text().replace(trainer_io.FORMAT, "gpuregress-trainer-checkpoint/0"))
    else:
        target.unlink()
    with pytest.raises(CheckpointProblem) as caught:
        trainer_io.load(fresh(ctx), folder, with_rng=True, device_kind="cpu")
    assert caught.value.path == str(target)
    assert caught.value.problem.startswith(problem)
    if damage != "shard":  # the shard's fix is sharded.py's own (shared storage)
        assert caught.value.fix.startswith(trainer_io.SAVE_AGAIN)
