"""Clipping that acts and the AdamW implementations users run (#35 items 1 and 2): the faults that emulate a wrong
clip and a bug in one AdamW path, the comparison that names them, and the shipped references that exercise both.
In-process and synthetic; the end-to-end catches are in test_training_e2e.py and test_lora_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pytest_gpuregress import faults
from pytest_gpuregress.evidence import clipping
from pytest_gpuregress.faults import firing, reach
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.training.optimizer import AdamWSettings, adamw
from pytest_gpuregress.triage.naming import described, rule_for

from ..conftest import compare_named

REPO = Path(__file__).resolve().parents[2]


def _ctx() -> SimpleNamespace:
    return SimpleNamespace(rank=0, world_size=1, device_kind="cpu", cleanup_hooks=[], step_hooks=[], teardown_hooks=[])


def _undo(ctx: SimpleNamespace) -> None:
    for undo in reversed(ctx.cleanup_hooks):
        undo()


def _grads(norm: float) -> list:
    import torch

    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((4,), norm / np.sqrt(8.0))
    return params


def _norm(params: list) -> float:
    return float(np.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params)))


@pytest.mark.parametrize("mode, expected", [("scale", 0.5 * 1.001), ("skip", 2.0)])
def test_a_wrong_clip_acts_only_where_the_clip_acts_and_counts_there(mode: str, expected: float) -> None:
    import torch

    ctx = _ctx()
    (installed,) = faults.install_counted([f"clip:mode={mode},rel=1e-3"], ctx)
    try:
        unclipped = _grads(0.3)
        assert float(torch.nn.utils.clip_grad_norm_(unclipped, 0.5)) == pytest.approx(0.3)
        assert _norm(unclipped) == pytest.approx(0.3, rel=1e-6) and installed.count == 0  # below max_norm: untouched
        clipped = _grads(2.0)
        assert float(torch.nn.utils.clip_grad_norm_(clipped, 0.5)) == pytest.approx(2.0)  # the norm before clipping
        assert _norm(clipped) == pytest.approx(expected, rel=1e-5)
        assert firing.rank_counts([installed]) == {installed.spec: 1}
    finally:
        _undo(ctx)
    right = _grads(2.0)
    torch.nn.utils.clip_grad_norm_(right, 0.5)
    assert _norm(right) == pytest.approx(0.5, rel=1e-5)  # uninstalled: torch's own clip again


@pytest.mark.parametrize("broken", ["single", "foreach", "fused"])
def test_an_adamw_fault_changes_only_its_own_implementation(broken: str) -> None:
    import torch

    def stepped(implementation: str) -> np.ndarray:
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(16))
        settings = AdamWSettings(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation=implementation)
        optimizer = adamw([weight], settings)
        for _ in range(3):
            weight.grad = torch.linspace(-1, 1, 16)
            optimizer.step()
        return weight.detach().numpy().copy()

    clean = {impl: stepped(impl) for impl in ("single", "foreach", "fused")}
    ctx = _ctx()
    (installed,) = faults.install_counted([f"adamw:mode={broken},factor=1.01"], ctx)
    try:
        faulty = {impl: stepped(impl) for impl in ("single", "foreach", "fused")}
    finally:
        _undo(ctx)
    assert installed.count == 3  # one per step through the broken path
    for impl in clean:
        assert np.array_equal(faulty[impl], clean[impl]) == (impl != broken), impl


def test_the_config_names_the_implementation_and_a_wrong_name_is_refused() -> None:
    base = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    assert AdamWSettings.from_config(base).implementation == "single"  # references recorded before the key existed
    optimizer = adamw([__import__("torch").nn.Parameter(__import__("torch").zeros(2))],
                      AdamWSettings.from_config({**base, "adamw": "fused"}))
    assert optimizer.defaults["fused"] is True and not optimizer.defaults["foreach"]
    with pytest.raises(ValueError, match="adamw='fast'"):
        AdamWSettings.from_config({**base, "adamw": "fast"})


def _record(clipped: list[float], loss: list[float] | None = None, adamw: str | None = "fused") -> RunRecord:
    grad = [0.9, 0.8, 0.4, 0.7, 0.3]
    config = {"grad_clip": 0.5, **({"adamw": adamw} if adamw else {})}
    return RunRecord("fsdp", config, "cpu-gloo-w2-fp32", 2, fingerprint={},
                     series={"loss": loss or [5.0, 4.9, 4.8, 4.7, 4.6], "grad_norm": grad, "clipped_grad_norm": clipped})


REFERENCE_CLIPPED = [0.5, 0.5, 0.4, 0.5, 0.3]


def test_a_clip_that_went_wrong_before_anything_else_is_named_the_optimizer_with_its_implementation() -> None:
    run = _record([0.5, 0.5005, 0.4, 0.5, 0.3], loss=[5.0, 4.9, 4.81, 4.7, 4.6])  # the loss moves one step later
    comparison = compare_named(_record(REFERENCE_CLIPPED), run, lane="tolerant")
    assert {f.metric: f.component for f in comparison.findings} == {"clipped_grad_norm": "optimizer", "loss": "optimizer"}
    clip = next(f for f in comparison.findings if f.metric == "clipped_grad_norm")
    assert (clip.step, clip.rule) == (1, "clip-moved-first") and "before clipping match at step 1" in clip.message
    assert "AdamW implementation: fused" in clip.message


def test_a_loss_that_moved_at_the_clips_step_is_not_blamed_on_the_clip() -> None:
    run = _record([0.5, 0.5005, 0.4, 0.5, 0.3], loss=[5.0, 4.91, 4.8, 4.7, 4.6])  # wrong before the clip ran
    comparison = compare_named(_record(REFERENCE_CLIPPED), run, lane="tolerant")
    assert all("before clipping match" not in f.message for f in comparison.findings)
    assert {f.component for f in comparison.findings} == {"optimizer or collective"}


def test_a_clean_run_passes_and_a_users_loop_is_not_told_an_implementation() -> None:
    assert compare_named(_record(REFERENCE_CLIPPED), _record(list(REFERENCE_CLIPPED)), lane="exact").passed
    users = compare_named(_record(REFERENCE_CLIPPED, adamw=None), _record([0.5, 0.6, 0.4, 0.5, 0.3], adamw=None),
                             lane="tolerant")
    assert users.findings and all("AdamW implementation" not in f.message for f in users.findings)


def test_clipping_is_counted_from_the_record_and_a_clip_that_rarely_acts_is_said_at_recording() -> None:
    counted = clipping.of(_record(REFERENCE_CLIPPED))
    assert counted is not None and (counted.clipped, counted.steps) == (3, 5)
    assert counted.max_norm == 0.5 and counted.warning() is None
    assert counted.describe().endswith("acted on 3 of 5 steps (max norm 0.5)")
    rarely = clipping.Clipping(0.5, 2, 300)
    assert rarely.warning() is not None and "the clip itself is barely exercised" in rarely.warning()
    assert clipping.Clipping(0.5, 299, 300).warning() is None  # torch scales by the clamped coefficient every step
    assert clipping.of(RunRecord("mine", {}, "p", 2, series={"grad_norm": [1.0]})) is None  # a loop without a clip


def _shipped(scenario: str) -> list[tuple[str, dict]]:
    return [(str(path.parent.relative_to(REPO)), json.loads(path.read_text()))
            for path in sorted((REPO / "reference_runs").glob(f"{scenario}*/*/record.json"))]


@pytest.mark.parametrize("scenario", ["fsdp", "lora"])
def test_every_shipped_training_reference_clips_on_a_real_share_of_its_steps(scenario: str) -> None:
    shipped = _shipped(scenario)
    assert len(shipped) >= 3
    for where, data in shipped:
        record = RunRecord.from_json(data)
        counted = clipping.of(record)
        assert counted is not None and counted.warning() is None, (where, counted)
        assert "clipped_grad_norm" in record.series, where


def test_the_shipped_references_run_every_adamw_implementation_the_reach_table_says() -> None:
    ran = {where: data["config"].get("adamw", "single") for where, data in _shipped("fsdp") + _shipped("lora")}
    assert set(ran.values()) == {"fused", "foreach"}  # the single-tensor loop: the checkpoint scenario's
    for where, implementation in ran.items():
        case = "fsdp" if where.startswith("reference_runs/fsdp") else \
            "lora-fully_shard" if where.endswith("fsdp2") else "lora-accelerate"
        assert reach.reaches(faults.parse(f"adamw:mode={implementation}"), reach.catalogue("cpu")[case]), where


def _clipped_record(reported_factor: float = 1.0, coefficient_factor: float = 1.0):  # type: ignore[no-untyped-def]
    """A record whose clip (max_norm 0.5) reported its norm x ``reported_factor`` and scaled x ``coefficient_factor``."""
    from ..conftest import make_record

    record = make_record(steps=6)
    norms = np.full((6, 2), 0.6)  # each parameter's norm: the gradients' norm is 0.6 sqrt(2) = 0.85 > 0.5
    before = np.sqrt((norms ** 2).sum(axis=1))
    reported = before * reported_factor
    record.config = {**record.config, "grad_clip": 0.5}
    record.arrays = {**record.arrays, "param_grad_norm": norms}
    record.series = {**record.series, "grad_norm": list(reported),
                     "clipped_grad_norm": list(before * np.minimum(1, 0.5 / (before + 1e-6)) * coefficient_factor)}
    return record


def test_a_clip_is_held_to_its_own_norm() -> None:
    """#46 item 6: a clip that takes the norm of its own rank's shard (a real torch issue class over DTensors), or
    scales by a coefficient off by 1e-3, is [optimizer] on its own evidence; a right one says nothing."""
    assert clipping.problems(_clipped_record()) == []
    shard = clipping.problems(_clipped_record(reported_factor=2 ** -0.5))
    assert len(shard) == 1 and shard[0].check == "clip" and "reported another norm" in shard[0].message
    assert rule_for(shard[0]).id == "clip-inconsistent" and described(shard[0]).startswith("[optimizer] the clip")
    said = shard[0].message
    assert f"(ratio {2 ** -0.5:.6g}; " in said and "; about 1/sqrt(2) of it" in said and "rank's shard" in said
    off = clipping.problems(_clipped_record(coefficient_factor=1 + 1e-3))
    assert len(off) == 1 and off[0].message.startswith("the clip scaled the gradients by")
    assert "off by 0.001" in off[0].message
    # the helper's 11h: 5e-5 fails the clipped norm's tolerance (5.5e-7); clean runs agree to 2e-7
    assert len(clipping.problems(_clipped_record(coefficient_factor=1 + 5e-5))) == 1
    assert clipping.problems(_clipped_record(coefficient_factor=1 + 2e-7, reported_factor=1 - 2e-7)) == []


def test_the_clips_limit_widens_with_the_largest_gradient_it_sums_in_float32() -> None:
    """A 32k vocabulary's head (2M elements) put 4.5e-5 between a clean clip's float32 norm and the float64 one:
    that model's limit is wider; the built-in models' stays 2e-5, which sees the helper's 5e-5 clip."""
    small = _with_head(_clipped_record(reported_factor=1 - 4.5e-5), vocabulary=256)
    assert clipping.consistency_limit(small) == clipping.CONSISTENCY
    assert len(clipping.problems(small)) == 1
    large = _with_head(_clipped_record(reported_factor=1 - 4.5e-5))
    assert clipping.consistency_limit(large) == pytest.approx(clipping.CONSISTENCY * (32_000 * 64 / 65536) ** 0.5)
    assert clipping.problems(large) == []
    # A GPU-size head (128k x 4096) is held to CONSISTENCY_MAX: a clip off by a tenth of a percent still fails.
    huge = _with_head(_clipped_record(coefficient_factor=1 + 2e-3), vocabulary=128_000)
    huge.arrays = {**huge.arrays, "step0_grad/lm_head.weight": np.broadcast_to(np.float32(0), (128_000 * 64, 64))}
    assert clipping.consistency_limit(huge) == clipping.CONSISTENCY_MAX
    assert len(clipping.problems(huge)) == 1
    assert len(clipping.problems(_with_head(_clipped_record(reported_factor=2 ** -0.5)))) == 1  # a shard's norm still is
    # A gradient that large is kept as blocks (evidence/step0.py): their element counts give its size.
    from pytest_gpuregress.evidence import step0

    blocked = _clipped_record(reported_factor=1 - 4.5e-5)
    blocked.arrays = {**blocked.arrays, "step0_blocks/lm_head.weight": step0.summarize(np.zeros(32_000 * 64))}
    assert clipping.consistency_limit(blocked) == clipping.consistency_limit(large) and clipping.problems(blocked) == []


def _with_head(record: RunRecord, vocabulary: int = 32_000) -> RunRecord:
    """``record`` with a step-0 gradient of an output head of ``vocabulary`` x 64."""
    record.arrays = {**record.arrays, "step0_grad/lm_head.weight": np.zeros((vocabulary, 64), dtype=np.float32)}
    return record
