"""The fsdp scenario's rank code (scenarios/fsdp/rank.py) at one gloo rank, in this process: its record, its noise
replicas' weights, and its resume roles, whose continuation repeats the run's last step bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pytest_gpuregress.evidence.op_trace import TRACE_CONFIG
from pytest_gpuregress.evidence.step0 import FULL_PREFIX
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.base import RankContext, Setup
from pytest_gpuregress.scenarios.fsdp import SCENARIO, rank
from pytest_gpuregress.scenarios.shared.resume_roles import FOLDER, RESULT_KEY, ROLE, resume_step
from pytest_gpuregress.training import dcp_safetensors, resume_checkpoint
from pytest_gpuregress.training.fsdp2 import RESULT_KEY as UNITS
from pytest_gpuregress.training.models import blueprint

pytestmark = pytest.mark.usefixtures("kept_generators", "one_rank_group")

STEPS = 4  # the resume roles save after 3 and continue with the last


def config(**more: Any) -> dict[str, Any]:
    """fsdp's CPU config at one rank, 4 steps of 4 sequences of 16 tokens, no op trace."""
    return {**SCENARIO.default_config(Setup("cpu", "gloo", 1, steps=STEPS)), "global_batch": 4, "seq_len": 16,
            TRACE_CONFIG: False, **more}


def ctx_of(folder: Path, **more: Any) -> RankContext:
    return RankContext(0, 1, 0, "cpu", "gloo", config(**more), folder, profile=False)


@pytest.fixture(scope="module")
def record(one_rank_group: None, tmp_path_factory: pytest.TempPathFactory) -> RunRecord:
    return rank.run(ctx_of(tmp_path_factory.mktemp("run")))


def test_the_record_keeps_the_curves_step0_gradients_units_and_digests(record: RunRecord) -> None:
    """Per step the loss and norms; every parameter's whole step-0 gradient (one rank holds the whole shard), whose
    norm is step 0's unclipped gradient norm; the fully_shard units; a digest per trained tensor."""
    names = record.param_names
    assert record.scenario == "fsdp" and record.world_size == 1 and len(names) == 21
    assert len(record.series["loss"]) == len(record.series["grad_norm"]) == STEPS
    assert record.arrays["param_grad_norm"].shape == (STEPS, len(names))
    grads = {name: record.arrays[FULL_PREFIX + name] for name in names}
    norm = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values())))
    assert norm == pytest.approx(record.series["grad_norm"][0], rel=1e-5)
    assert grads["model.embed_tokens.weight"].shape == (256, 64)
    assert list(record.results[UNITS]) == ["model.layers.0", "model.layers.1", ""]
    assert set(record.digests) == set(names)
    assert "op_trace" not in record.results  # the config turned it off


@pytest.mark.parametrize(("perturbation", "towards"), [("weights_ulp_up", np.inf), ("weights_ulp_down", -np.inf)])
def test_a_noise_replica_builds_every_weight_one_ulp_away(tmp_path: Path, perturbation: str, towards: float) -> None:
    """The replicas' model: the seeded weights, each element moved one fp32 ulp up (or down), nothing else."""
    plain_ctx, moved_ctx = ctx_of(tmp_path), ctx_of(tmp_path, perturbation=perturbation)
    plain = dict(rank.model(plain_ctx, plain_ctx.config, blueprint(plain_ctx.config)).named_parameters())
    moved = dict(rank.model(moved_ctx, moved_ctx.config, blueprint(moved_ctx.config)).named_parameters())
    assert set(plain) == set(moved)
    for name, weight in plain.items():
        expected = torch.nextafter(weight.detach(), torch.full_like(weight, towards))
        assert torch.equal(moved[name].detach(), expected), name


@pytest.fixture(scope="module")
def saved(one_rank_group: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunRecord, Path]:
    """fsdp-resume's save role: 3 steps, then the resume checkpoint."""
    folder = tmp_path_factory.mktemp("resume") / "resume"
    return rank.resume(ctx_of(folder.parent, **{ROLE: "save", FOLDER: str(folder)})), folder


def test_the_continuation_repeats_the_runs_last_step_bit_for_bit(record: RunRecord, saved: tuple[RunRecord, Path],
                                                                 tmp_path: Path) -> None:
    """Save after step 3 of 4, then a fresh trainer loads it and trains the last step: the loss and the trained
    weights are the full run's exactly."""
    save_record, folder = saved
    start = resume_step(config())
    assert save_record.results[RESULT_KEY]["step"] == start == STEPS - 1
    assert save_record.series["loss"] == record.series["loss"][:start]
    continued = rank.resume(ctx_of(tmp_path, **{ROLE: "continue", FOLDER: str(folder)}))
    assert "load_error" not in continued.results[RESULT_KEY]
    assert continued.results[RESULT_KEY]["step"] == start
    assert continued.series["loss"] == record.series["loss"][start:]
    assert continued.digests == record.digests


def test_a_checkpoint_dcp_cannot_load_is_the_continuations_load_error(saved: tuple[RunRecord, Path],
                                                                      tmp_path: Path) -> None:
    """A weight missing from the checkpoint's shard: the continue role records the load error the verdict names
    (resume_load), it does not crash the rank."""
    _, folder = saved
    broken = Path(shutil.copytree(folder, tmp_path / "resume"))
    [shard] = dcp_safetensors.shard_files(broken / resume_checkpoint.TENSORS)
    with safe_open(str(shard), "pt") as fh:
        metadata = fh.metadata()
        tensors = {key: fh.get_tensor(key) for key in fh.keys() if key != "model.model.norm.weight"}
    index = {k: v for k, v in json.loads(metadata["DCP_SHARDING_INFO"]).items() if k in tensors}
    save_file(tensors, str(shard), metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(index)})
    continued = rank.resume(ctx_of(tmp_path, **{ROLE: "continue", FOLDER: str(broken)}))
    error = continued.results[RESULT_KEY]["load_error"]
    assert error.startswith("CheckpointProblem: ") and error.endswith("model.model.norm.weight.")
