"""The Recorder a user's own loop fills: series, arrays and digests as the built-in scenarios record them.

One process, world size 1: without a process group for plain models, with a one-rank gloo group
for FSDP2 (DTensor gradients). Reductions over two ranks are checked end to end through the
example (tests/training/test_own_loop_example.py). The loops here are written out by hand, as a user's are;
the wrapping and the optimizer are the built-in scenarios' own (training/fsdp2.py, optimizer.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pytest_gpuregress import Recorder
from pytest_gpuregress.comparison import failfast
from pytest_gpuregress.comparison.compare import compare_training, tolerant_limits
from pytest_gpuregress.errors import UnsafeName
from pytest_gpuregress.recorder import RecorderMisuse
from pytest_gpuregress.reference.record import RunRecord, float_digest
from pytest_gpuregress.scenarios import RankContext
from pytest_gpuregress.training.fsdp2 import shard
from pytest_gpuregress.training.loop import TrainStep, clip_gradients
from pytest_gpuregress.training.loop import train as shared_loop
from pytest_gpuregress.training.optimizer import AdamWSettings, Optimization, Schedule, adamw

TINY_ADAMW = AdamWSettings(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)  # torch's defaults but lr


def make_ctx(tmp_path: Path, **config: Any) -> RankContext:
    return RankContext(rank=0, world_size=1, local_rank=0, device_kind="cpu", backend="gloo",
                       config={"steps": 5, **config}, run_dir=tmp_path, progress_path=tmp_path / "progress")


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def sharded_tiny_model() -> torch.nn.Module:
    """The tiny model under FSDP2 as the scenarios wrap theirs: its first layer, then the root."""
    model = tiny_model()
    shard([("0", model[0]), ("", model)])
    return model


def train(ctx: RankContext, model: torch.nn.Module, *, nudge_step: int | None = None,
          seen: list[dict[str, torch.Tensor]] | None = None, pass_norm: bool = False) -> RunRecord:
    """A few AdamW steps on fixed data; ``nudge_step``: the loss handed to the recorder there is off by 1e-5."""
    opt = adamw(list(model.parameters()), TINY_ADAMW)
    rec = Recorder(ctx, "tiny")
    generator = torch.Generator().manual_seed(1)
    for step in range(ctx.config["steps"]):
        x = torch.randn(6, 4, generator=generator)
        loss = model(x).pow(2).mean()
        loss.backward()
        if seen is not None:
            seen.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        rec.gradients(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad()
        value = loss * (1 + 1e-5) if step == nudge_step else loss
        rec.step(value, grad_norm=norm if pass_norm else None)
    rec.weights(model)
    rec.tensor("probe", model(torch.ones(3, 4)).detach())
    return rec.record()


def test_losses_alone_make_a_record(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, steps=3)
    fired: list[tuple[int, int]] = []
    ctx.step_hooks.append(lambda rank, step: fired.append((rank, step)))  # what injected step faults use
    rec = Recorder(ctx, "losses-only")
    assert rec.step(2.5) is False
    assert rec.step(torch.tensor(1.25, dtype=torch.bfloat16)) is False
    assert rec.step(torch.tensor([0.5])) is False
    record = rec.record()
    assert record.scenario == "losses-only" and record.config == {"steps": 3} and record.world_size == 1
    assert record.series == {"loss": [2.5, 1.25, 0.5]} and record.steps == 3
    assert all(type(v) is float for v in record.series["loss"])
    assert record.arrays == {} and record.digests == {} and record.param_names == []
    assert "perf" not in record.results and record.timings["train_s"] > 0  # 3 steps: all of them warm-up
    assert fired == [(0, 0), (0, 1), (0, 2)]
    assert (tmp_path / "progress").read_text().splitlines()[-1] == "step 2 done, loss 0.5"
    assert compare_training(record, record).passed


def test_gradients_weights_and_tensors(tmp_path: Path) -> None:
    seen: list[dict[str, torch.Tensor]] = []
    model = tiny_model()
    record = train(make_ctx(tmp_path), model, seen=seen)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert record.param_names == names
    expected = np.array([[float(g[n].double().norm()) for n in names] for g in seen])
    np.testing.assert_allclose(record.arrays["param_grad_norm"], expected, rtol=1e-12)
    assert record.arrays["param_grad_norm"].dtype == np.float64
    # No grad_norm given: the norm of the gradients passed to gradients(), before clipping.
    np.testing.assert_allclose(record.series["grad_norm"], np.sqrt((expected**2).sum(axis=1)), rtol=1e-12)
    for name in names:
        np.testing.assert_array_equal(record.arrays[f"step0_grad/{name}"], seen[0][name].numpy())
    for name, p in model.named_parameters():
        assert record.digests[name] == float_digest(p.detach().numpy())
    assert record.digests["probe"]["shape"] == [3, 2]
    perf = record.results["perf"]  # as the built-in scenarios: steps after the 3 warm-up ones, and peak memory
    assert perf["steady_steps"] == 2 and perf["median_step_s"] > 0 and "peak_memory_bytes" in perf


def test_a_given_grad_norm_is_recorded_as_given(tmp_path: Path) -> None:
    record = train(make_ctx(tmp_path), tiny_model(), pass_norm=True)
    derived = np.sqrt((record.arrays["param_grad_norm"] ** 2).sum(axis=1))
    np.testing.assert_allclose(record.series["grad_norm"], derived, rtol=1e-6)  # clip_grad_norm_ sums in float32


def test_large_step0_gradients_are_kept_as_block_sums(tmp_path: Path) -> None:
    record = train(make_ctx(tmp_path, step0_full_max_elements=16), tiny_model())
    assert "step0_blocks/0.weight" in record.arrays and "step0_grad/2.weight" in record.arrays  # 32 and 16 elements


def test_fsdp2_shards_record_what_the_plain_model_records(tmp_path: Path, one_rank_group: None) -> None:
    plain = train(make_ctx(tmp_path), tiny_model())
    sharded_model = sharded_tiny_model()
    assert hasattr(next(sharded_model.parameters()), "to_local")  # parameters are DTensors now
    sharded = train(make_ctx(tmp_path), sharded_model, pass_norm=True)  # clip_grad_norm_ returns a DTensor here
    assert sharded.param_names == plain.param_names and sorted(sharded.arrays) == sorted(plain.arrays)
    for key in plain.arrays:
        np.testing.assert_allclose(sharded.arrays[key], plain.arrays[key], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(sharded.series["loss"], plain.series["loss"], rtol=1e-6)
    np.testing.assert_allclose(sharded.series["grad_norm"], plain.series["grad_norm"], rtol=1e-5)
    assert sorted(sharded.digests) == sorted(plain.digests)
    assert sharded.digests["2.weight"]["shape"] == [2, 8]


def test_the_recorder_records_what_the_scenarios_loop_records(tmp_path: Path, one_rank_group: None) -> None:
    """The built-in scenarios' loop (training/loop.py) and a user's loop with the Recorder, on the same sharded
    model, optimizer, schedule and data, record the same numbers: bit for bit, but for the per-parameter norms'
    square roots (taken by torch in the loop, by numpy in the Recorder: an ulp apart at most)."""
    steps, schedule = 5, Schedule(steps=5, warmup=2, min_ratio=0.1)
    model = sharded_tiny_model()
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(1)
    parts = TrainStep(loss=lambda _step: model(torch.randn(6, 4, generator=generator)).pow(2).mean(),
                      optimization=Optimization.of(adamw(params, TINY_ADAMW), schedule),
                      clip=lambda: clip_gradients(params, 10.0), tracked=params)
    curves = shared_loop(make_ctx(tmp_path), parts, range(steps))

    model = sharded_tiny_model()
    optimization = Optimization.of(adamw(list(model.parameters()), TINY_ADAMW), schedule)
    rec = Recorder(make_ctx(tmp_path), "tiny")
    generator = torch.Generator().manual_seed(1)
    for _step in range(steps):
        loss = model(torch.randn(6, 4, generator=generator)).pow(2).mean()
        loss.backward()
        rec.gradients(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimization.step()
        rec.step(loss, grad_norm=norm)
    record = rec.record()
    assert record.series == {"loss": curves.losses, "grad_norm": curves.grad_norms}
    np.testing.assert_allclose(record.arrays["param_grad_norm"], curves.param_norms(len(params)), rtol=4e-16, atol=0)


def test_a_record_compares_clean_with_itself_and_names_a_changed_loss(tmp_path: Path) -> None:
    reference = train(make_ctx(tmp_path), tiny_model())
    assert compare_training(reference, train(make_ctx(tmp_path), tiny_model()), lane="exact").passed
    comparison = compare_training(reference, train(make_ctx(tmp_path), tiny_model(), nudge_step=2), lane="exact")
    assert [f.metric for f in comparison.findings] == ["loss"]
    assert comparison.findings[0].step == 2
    assert "loss: first differing step 2 of 5" in comparison.findings[0].message
    tolerant = compare_training(reference, train(make_ctx(tmp_path), tiny_model(), nudge_step=2), lane="tolerant")
    assert [f.metric for f in tolerant.findings] == ["loss"]  # 1e-5 is past the fixed fp32 limit (1e-6)


def test_step_returns_true_when_fail_fast_says_stop(tmp_path: Path) -> None:
    reference = train(make_ctx(tmp_path), tiny_model())
    ctx = make_ctx(tmp_path)
    ctx.watch = failfast.watch_from(reference, tolerant_limits(reference)[0])
    rec = Recorder(ctx, "tiny")
    answers = [rec.step(loss) for loss in reference.series["loss"][:2]]
    answers.append(rec.step(reference.series["loss"][2] * 1.01))
    assert answers == [False, False, True]
    assert ctx.stopped is not None and ctx.stopped["step"] == 2 and ctx.stopped["metric"] == "loss"


def test_misuse_is_refused_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(UnsafeName):
        Recorder(make_ctx(tmp_path), "../elsewhere")
    rec = Recorder(make_ctx(tmp_path), "tiny")
    with pytest.raises(RecorderMisuse, match="no step recorded"):
        rec.record()
    with pytest.raises(RecorderMisuse, match="one-element tensor"):
        rec.step(torch.ones(2))
    with pytest.raises(RecorderMisuse, match="one-element tensor"):
        rec.step("low")

    model = tiny_model()
    model(torch.ones(1, 4)).sum().backward()
    rec = Recorder(make_ctx(tmp_path), "tiny")
    rec.gradients(model)
    with pytest.raises(RecorderMisuse, match="twice in step 0"):
        rec.gradients(model)
    rec.step(1.0)
    with pytest.raises(RecorderMisuse, match="called at step 0 but not now"):
        rec.step(1.0)

    rec = Recorder(make_ctx(tmp_path), "tiny")
    rec.step(1.0)
    with pytest.raises(RecorderMisuse, match="first called at step 1"):
        rec.gradients(model)
    with pytest.raises(RecorderMisuse, match="grad_norm given on some steps"):
        rec.step(1.0, grad_norm=2.0)

    rec.tensor("probe", torch.ones(2))
    with pytest.raises(RecorderMisuse, match="'probe' is already recorded"):
        rec.tensor("probe", torch.ones(2))
    rec.weights(model)
    with pytest.raises(RecorderMisuse, match="weights\\(\\): '0.weight' is already recorded"):
        rec.weights(model)
    with pytest.raises(TypeError, match="named_parameters"):
        rec.weights([torch.ones(2)])


def test_phases_trace_step_0_only_with_module_paths_and_a_wrong_phase_is_refused(tmp_path: Path) -> None:
    from pytest_gpuregress.evidence.op_trace import ranks

    model = tiny_model()
    opt = adamw(list(model.parameters()), TINY_ADAMW)
    rec = Recorder(make_ctx(tmp_path, steps=3), "tiny", model=model)
    with pytest.raises(RecorderMisuse, match="the phases are forward, backward, clip, optimizer"):
        rec.phase("fwd")
    for _ in range(3):
        with rec.phase("forward"):
            loss = model(torch.ones(3, 4)).pow(2).mean()
        with rec.phase("backward"):
            loss.backward()
        with rec.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        rec.step(loss)
    trace = ranks(rec.record())[0]
    entries = [trace.entry(i) for i in range(len(trace))]
    phases = {e.phase for e in entries}
    assert phases == {"forward", "backward", "optimizer"}, phases
    assert any(e.op == "aten::addmm" and e.module == "0" and e.phase == "forward" for e in entries)
    # One step's ops only: step 0's forward has one addmm per layer, and later steps add none.
    assert sum(e.op == "aten::addmm" and e.phase == "forward" for e in entries) == 2
