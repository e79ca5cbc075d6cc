"""The README's own-loop example (examples/own_loop/), run as a user would: record, compare, break it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ..conftest import records_passes_and_breaks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop"


@pytest.fixture
def example(pytester: pytest.Pytester) -> pytest.Pytester:
    """The example folder as the pytester directory: the ranks import ``own_loop`` from the working directory."""
    shutil.copytree(EXAMPLE, pytester.path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "reference_runs", ".pytest_cache"))
    return pytester


@pytest.mark.slow
@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_the_example_records_passes_and_fails_when_its_loss_moves(example: pytest.Pytester, tmp_path: Path) -> None:
    refs = tmp_path / "refs"
    args = ["-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={refs}", "--gpuregress-perf=off",
            "-k", "own_loop", "test_own_loop.py"]

    # Every optimizer step with lr x 1.01: step 0's loss is the same, step 1's moves. The loop wraps its phases
    # in rec.phase(): step 0's op trace names AdamW's first op that moved, on the first layer's weight.
    records_passes_and_breaks(example.runpytest, args, refs, "own-loop", "lr_scale:factor=1.01",
                              ["*loss: first differing step 1 of 20: expected *, got *",
                               "*param_grad_norm: first differing step 1: *",
                               "first difference: aten::* in 0.weight (optimizer), f32[[]32, 16[]]* relative; the * ops "
                               "before it are bitwise equal (on ranks 0, 1 of 2, step-0 op trace); it was called with other "
                               "arguments: other=0.9999 in the reference, other=0.999899 now*"])
    # Recording ran the noise replicas, each perturbed by the loop's Recorder: their spread is the envelope.
    stored = json.loads((refs / "own-loop" / "cpu-gloo-w2-fp32" / "record.json").read_text())
    assert stored["results"]["envelope"]["replicas"] == ["replica-weights_ulp_up", "replica-reduction_order",
                                                        "replica-kernel_path"]
    assert not any("adds no spread" in note for note in stored["notes"])
    # Fail-fast knows the reference (gpuregress.run(..., reference=)): a bigger lr change stops the run early.
    stopped = example.runpytest(*args, "--gpuregress-fail-fast", "--gpuregress-lane=tolerant",
                                "--gpuregress-inject=lr_scale:factor=1.5")
    stopped.assert_outcomes(failed=1)
    stopped.stdout.fnmatch_lines(["*fail-fast: stopped at step *"])


PARALLEL = '''
import numpy as np


def test_own_loop_ddp_and_fsdp_agree(gpuregress):
    ddp = gpuregress.run("own_loop:train", config={"steps": 4, "parallel": "ddp"})
    fsdp = gpuregress.run("own_loop:train", config={"steps": 4, "parallel": "fsdp"})
    assert ddp.param_names == ["module." + name for name in fsdp.param_names]
    np.testing.assert_allclose(ddp.series["loss"], fsdp.series["loss"], rtol=1e-6)
    np.testing.assert_allclose(ddp.series["grad_norm"], fsdp.series["grad_norm"], rtol=1e-6)
    np.testing.assert_allclose(ddp.arrays["param_grad_norm"], fsdp.arrays["param_grad_norm"], rtol=1e-5)
    for name in fsdp.param_names:  # whole gradients on rank 0: DDP's replica, FSDP2's gathered shards
        grad = fsdp.arrays["step0_grad/" + name]
        assert grad.shape == tuple(fsdp.digests[name]["shape"])
        np.testing.assert_allclose(ddp.arrays["step0_grad/module." + name], grad, rtol=1e-5, atol=1e-8)
'''


@pytest.mark.slow
def test_replicated_and_sharded_gradients_are_reduced_alike(example: pytest.Pytester) -> None:
    """Two ranks: DDP replicas are averaged, FSDP2 shards add up, and both give the model's own numbers."""
    example.makepyfile(test_parallel=PARALLEL)
    result = example.runpytest("-p", "no:cacheprovider", "--gpuregress", "--gpuregress-perf=off",
                               "-k", "ddp_and_fsdp", "test_parallel.py")
    result.assert_outcomes(passed=1)
