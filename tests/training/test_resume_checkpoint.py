"""The resume checkpoint (training/resume_checkpoint.py) of a tiny FSDP2 trainer at one gloo rank: safetensors and
JSON only, a round trip that restores every piece of state and continues bit for bit, a tensor changed in the shard
file named by the state digests, and a damaged folder refused naming its file."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pytest_gpuregress.errors import CheckpointProblem
from pytest_gpuregress.training import dcp_safetensors, resume_checkpoint, rng_state, state_digests
from pytest_gpuregress.training.fsdp2 import shard
from pytest_gpuregress.training.optimizer import AdamWSettings, Optimization, Optimized, Schedule, adamw

pytestmark = pytest.mark.usefixtures("kept_generators")

SAVED_AT, STEPS = 2, 4
SETTINGS = AdamWSettings(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
Digests = dict[str, dict[str, str]]


@dataclass
class TinyTrainer(Optimized):
    """A Resumable: a two-layer MLP under FSDP2 (its first layer, then the root), AdamW and its schedule. Each
    step draws its batch from torch's global generator, so a generator left unrestored changes the numbers."""

    model: torch.nn.Module
    names: list[str]
    optimization: Optimization

    @classmethod
    def build(cls, seed: int) -> TinyTrainer:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        shard([("0", model[0]), ("", model)])
        names = [name for name, _ in model.named_parameters()]
        return cls(model, names, Optimization.of(adamw(list(model.parameters()), SETTINGS), Schedule(STEPS, 2, 0.1)))

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            loss = self.model(torch.randn(6, 4)).pow(2).mean()
            loss.backward()
            self.optimization.step()
            losses.append(float(loss.detach()))
        return losses


@dataclass(frozen=True)
class Saved:
    folder: Path
    boundary: Digests  # the saving trainer's state right after the save
    continued: list[float]  # its losses after the save


def save(trainer: TinyTrainer, folder: Path) -> None:
    resume_checkpoint.save(trainer, folder, step=SAVED_AT, data_position=SAVED_AT, rank=0, world_size=1,
                           device_kind="cpu")


@pytest.fixture(scope="module")
def saved(one_rank_group: None, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """Train SAVED_AT steps, save, digest, train on: once for the module (its generators put back)."""
    states = rng_state.capture("cpu")
    try:
        trainer = TinyTrainer.build(seed=0)
        trainer.train(SAVED_AT)
        folder = tmp_path_factory.mktemp("saved") / "resume"
        save(trainer, folder)
        boundary = state_digests.boundary(trainer, SAVED_AT, "cpu", 0)
        continued = trainer.train(STEPS - SAVED_AT)
    finally:
        rng_state.restore(states, "cpu")
    return Saved(folder, boundary, continued)


@pytest.fixture
def folder(saved: Saved, tmp_path: Path) -> Path:
    """A private copy of the saved checkpoint, for a test that damages it."""
    return Path(shutil.copytree(saved.folder, tmp_path / "resume"))


def loaded(folder: Path) -> tuple[TinyTrainer, dict[str, object]]:
    """A trainer built from another seed, its generators scrambled, then loaded from ``folder``; and trainer.json."""
    trainer = TinyTrainer.build(seed=1)
    rng_state.scramble(123_456_789, "cpu")
    return trainer, resume_checkpoint.load(trainer, folder, rank=0, device_kind="cpu")


def differing(saved: Digests, trainer: TinyTrainer) -> set[tuple[str, str]]:
    """(piece, item) of every state digest of ``trainer`` that is not the saved one."""
    now = state_digests.boundary(trainer, SAVED_AT, "cpu", 0)
    return {(piece, item) for piece, items in saved.items() for item, digest in items.items()
            if now.get(piece, {}).get(item) != digest}


def rewrite_shard(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    """Rewrite the one safetensors shard with each named tensor replaced (None: removed, from DCP's index too)."""
    [path] = dcp_safetensors.shard_files(folder / resume_checkpoint.TENSORS)
    with safe_open(str(path), "pt") as fh:
        metadata = fh.metadata()
        tensors = {key: fh.get_tensor(key) for key in fh.keys()}
    index = json.loads(metadata["DCP_SHARDING_INFO"])
    for key, value in change.items():
        if value is None:
            del tensors[key], index[key]
        else:
            tensors[key] = value
    save_file(tensors, str(path), metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(index)})


def test_the_checkpoint_is_safetensors_and_json_only(saved: Saved) -> None:
    """No pickle anywhere: safetensors shards (no DCP .metadata), this rank's generators and trainer.json, which
    holds the step, the data position, the world size, the schedule without its lambdas and the torch version."""
    assert sorted(p.name for p in saved.folder.iterdir()) == ["rng-rank0.json", resume_checkpoint.TENSORS,
                                                              resume_checkpoint.TRAINER_JSON]
    files = list((saved.folder / resume_checkpoint.TENSORS).iterdir())
    assert files and all(p.name.endswith(dcp_safetensors.SUFFIX) for p in files)
    meta = resume_checkpoint.read_meta(saved.folder)
    assert meta["format"] == resume_checkpoint.FORMAT and meta["torch"] == torch.__version__
    assert (meta["step"], meta["data_position"], meta["world_size"]) == (SAVED_AT, SAVED_AT, 1)
    assert meta["scheduler"]["last_epoch"] == SAVED_AT and "lr_lambdas" not in meta["scheduler"]
    assert [group["lr"] for group in meta["param_groups"]] == [SETTINGS.lr]  # warm-up done: the schedule's peak


def test_a_load_restores_every_piece_and_training_goes_on_bit_for_bit(saved: Saved) -> None:
    """Into a trainer built from another seed: weights, moments, step, param groups, schedule and generators as
    saved, and the next steps' losses those of the saving run exactly."""
    trainer, meta = loaded(saved.folder)
    assert meta["step"] == SAVED_AT
    assert differing(saved.boundary, trainer) == set()
    assert trainer.train(STEPS - SAVED_AT) == saved.continued


def test_a_tensor_changed_in_the_shard_file_is_named_by_the_state_digests(folder: Path, saved: Saved) -> None:
    """One exp_avg element changed on disk: the load takes it, and only that piece of that parameter differs."""
    [path] = dcp_safetensors.shard_files(folder / resume_checkpoint.TENSORS)
    with safe_open(str(path), "pt") as fh:
        moment = fh.get_tensor("optim.2.weight.exp_avg").clone()
    moment.view(-1)[0] += 1e-3
    rewrite_shard(folder, {"optim.2.weight.exp_avg": moment})
    trainer, _ = loaded(folder)
    assert differing(saved.boundary, trainer) == {("optimizer.exp_avg", "2.weight")}
    assert trainer.train(STEPS - SAVED_AT) != saved.continued


def test_a_key_missing_from_the_shard_is_a_checkpoint_problem(folder: Path) -> None:
    """A weight absent from the shard: DCP's own error (a BaseException, which an ``except Exception`` would miss)
    comes out as a CheckpointProblem naming the tensors folder and the key."""
    rewrite_shard(folder, {"model.2.bias": None})
    with pytest.raises(CheckpointProblem) as caught:
        loaded(folder)
    assert caught.value.path == str(folder / resume_checkpoint.TENSORS)
    assert caught.value.problem.startswith("DCP cannot load it: ") and "rank 0: RuntimeError" in caught.value.problem
    assert caught.value.problem.endswith("model.2.bias.")


@pytest.mark.parametrize(("damage", "problem"), [
    ("no trainer.json", "missing"),
    ("trainer.json not JSON", "not JSON"),
    ("trainer.json a list", "not a JSON object"),
    ("another format", "format 'gpuregress-resume-checkpoint/0'"),
    ("no generators", "missing"),
    ("no shard", "no safetensors shard"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(folder: Path, damage: str, problem: str) -> None:
    """Each damage: a CheckpointProblem naming the file (or the tensors folder) and the fix, to record again."""
    meta, tensors = folder / resume_checkpoint.TRAINER_JSON, folder / resume_checkpoint.TENSORS
    text = meta.read_text()
    named = {"no generators": resume_checkpoint.rng_file(folder, 0), "no shard": tensors}.get(damage, meta)
    if damage == "no trainer.json":
        meta.unlink()
    elif damage == "trainer.json not JSON":
        meta.write_text(text[: len(text) // 2])
    elif damage == "trainer.json a list":
        meta.write_text("[]")
    elif damage == "another format":
        meta.write_text(text.replace(resume_checkpoint.FORMAT, "gpuregress-resume-checkpoint/0"))
    elif damage == "no generators":
        named.unlink()
    else:
        for path in dcp_safetensors.shard_files(tensors):
            path.unlink()
    with pytest.raises(CheckpointProblem) as caught:
        loaded(folder)
    assert caught.value.path == str(named)
    assert caught.value.problem.startswith(problem)
    assert caught.value.fix.startswith("record the reference again")


def test_detached_copies_are_separate_tensors_of_the_same_values() -> None:
    """What a load fills: copies of every nested tensor, detached, so the load and the apply are separate steps."""
    weight = torch.ones(2, 3, requires_grad=True)
    state = {"model": {"w": weight}, "optim": {"w": {"exp_avg": torch.zeros(2, 3)}}}
    copies = resume_checkpoint.detached_copies(state)
    assert torch.equal(copies["model"]["w"], weight) and not copies["model"]["w"].requires_grad
    copies["model"]["w"].add_(1.0)
    copies["optim"]["w"]["exp_avg"].add_(1.0)
    assert torch.equal(weight, torch.ones(2, 3)) and torch.equal(state["optim"]["w"]["exp_avg"], torch.zeros(2, 3))
