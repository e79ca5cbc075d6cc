"""End to end through pytester: real gloo ranks, real FSDP2 training, injected faults.

One short reference (8 steps) is recorded once per session (conftest.py); every test compares against a copy.
Each test that injects a fault also checks the message names what a user needs: the metric,
step, tensor, component, rank or file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ..conftest import FSDP_ONLY, FSDP_STEPS, collected, printed_command

pytestmark = pytest.mark.slow

STEPS = FSDP_STEPS


@pytest.fixture
def recorded(fsdp_reference: Path) -> Path:
    """The session's fsdp reference at 8 steps (conftest.py); tests that change it work on ``refs``, a copy."""
    return fsdp_reference


def run(pytester: pytest.Pytester, refs: Path, *extra: str) -> pytest.RunResult:
    return pytester.runpytest(
        "-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={STEPS}",
        f"--gpuregress-reference-dir={refs}", "-k", FSDP_ONLY, *extra,
    )


def test_recorded_reference_passes_in_the_exact_lane_every_time(pytester: pytest.Pytester, refs: Path) -> None:
    for _ in range(2):
        result = run(pytester, refs, "-W", "default")
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["fsdp cpu-gloo-w2-fp32: PASSED [[]exact lane[]] 8 steps*"])
        # The kernel inventory matches its own reference, and the perf figures are compared as ratios.
        out = result.stdout.str()
        assert "kernels changed: 0" in out and "GpuRegressKernelWarning" not in out
        assert "perf vs reference: step time " in out and ", tokens/s " in out and ", peak memory " in out


def test_a_failed_run_is_kept_plotted_reported_and_reproducible(pytester: pytest.Pytester, refs: Path,
                                                                 tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    junit, html = tmp_path / "junit.xml", tmp_path / "report.html"
    fault = "collective:op=reduce_scatter,min_bytes=100000,max_bytes=160000,mode=nudge,rel=1e-3"
    result = run(pytester, refs, f"--gpuregress-inject={fault}", f"--gpuregress-artifacts={artifacts}",
                 f"--junitxml={junit}", *([f"--html={html}"] if importlib.util.find_spec("pytest_html") else []))
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    kept = artifacts / "runs" / "fsdp" / "cpu-gloo-w2-fp32"
    assert f"gpuregress artifacts: {artifacts}" in out  # named in the header, for CI to upload
    assert f"this run's record: {kept}" in out
    command = f"gpuregress compare {refs / 'fsdp' / 'cpu-gloo-w2-fp32'} {kept}"
    assert f"reproduce the comparison: {command}" in out
    assert f"reproduce fsdp: {command}" in out  # under the summary table too
    result.stdout.fnmatch_lines(["scenario*platform*lane*verdict*worst/tol*seconds",
                                 "fsdp*cpu-gloo-w2-fp32*exact*FAILED*x*"])
    plot = artifacts / "runs" / "fsdp" / "cpu-gloo-w2-fp32.png"
    if importlib.util.find_spec("matplotlib"):
        assert f"plot: {plot}" in out and plot.read_bytes()[:4] == b"\x89PNG"
    else:
        assert "pytest-gpuregress[plots]" in out
    # The printed command reproduces the same first finding, at the same step, from the kept files.
    first = next(line for line in out.splitlines() if "] step0_grad " in line).split("] ", 1)[1]
    reproduced = subprocess.run([sys.executable, "-c", "import sys; from pytest_gpuregress.cli import main; "
                                 "sys.exit(main(sys.argv[1:]))", *command.split()[1:]], capture_output=True, text=True)
    assert reproduced.returncode == 1 and first in reproduced.stdout, reproduced.stdout[-2000:]
    properties = {p.get("name"): p.get("value") for p in ET.parse(junit).iter("property")}
    assert properties["lane"] == "exact" and properties["platform_key"] == "cpu-gloo-w2-fp32"
    assert properties["first_differing_step"] == "0" and float(properties["worst_over_tolerance"]) > 1
    assert float(properties["seconds"]) > 0
    assert properties["component"] == "collective"  # the bracketed name, for dashboards that group failures
    assert properties["triage_verdict"].startswith("triage verdict: collective. Evidence: ")
    if importlib.util.find_spec("pytest_html"):  # the plot and the stack's changes, embedded
        report = html.read_text()
        assert "comparison plot" in report and "stack changes since the reference" in report


def test_a_passed_run_leaves_no_record_unless_asked(pytester: pytest.Pytester, refs: Path, tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    run(pytester, refs, f"--gpuregress-artifacts={artifacts}").assert_outcomes(passed=1)
    assert not (artifacts / "runs").exists()
    run(pytester, refs, f"--gpuregress-artifacts={artifacts}", "--gpuregress-keep-runs").assert_outcomes(passed=1)
    assert (artifacts / "runs" / "fsdp" / "cpu-gloo-w2-fp32" / "manifest.json").is_file()


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_fail_fast_stops_at_the_first_step_outside_tolerance(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, "--gpuregress-fail-fast", "--gpuregress-inject=lr_scale:factor=2")
    result.assert_outcomes(failed=1)
    # lr x 2 first shows in the loss of step 1; the run stops there instead of running all 8 steps.
    result.stdout.fnmatch_lines(["*fail-fast: stopped at step 1 of 8: loss expected *, got * (rel * > tol *)*",
                                 "fsdp cpu-gloo-w2-fp32: FAILED * 2 steps, loss *"])
    assert "reference has 8 steps" not in result.stdout.str()  # compared over the steps that ran


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_fail_fast_stops_every_rank_together_when_only_one_rank_sees_a_miss(pytester: pytest.Pytester,
                                                                          refs: Path) -> None:
    # Rank 1's all-reduces come back zero: its loss leaves the reference, rank 0's does not. A rank that
    # stopped alone would leave its peer waiting in a collective until the timeout.
    started = time.monotonic()
    result = run(pytester, refs, "--gpuregress-fail-fast", "--gpuregress-timeout=60",
                 "--gpuregress-inject=collective:op=all_reduce,ranks=1,mode=zeros")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*fail-fast: stopped at step 0 of 8: another rank*left the tolerance*"])
    assert "hung" not in result.stdout.str() and time.monotonic() - started < 60


def test_fail_fast_on_a_clean_run_runs_every_step_and_passes(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, "--gpuregress-fail-fast")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["fsdp cpu-gloo-w2-fp32: PASSED [[]exact lane[]] 8 steps*"])


def test_reduce_scatter_corrupted_in_one_size_band_is_caught(pytester: pytest.Pytester, refs: Path) -> None:
    # The root group (embedding, lm_head, final norm) reduce-scatters 131,328 bytes; each decoder
    # layer 184,832. The band hits the root group only.
    fault = "collective:op=reduce_scatter,min_bytes=100000,max_bytes=160000,mode=nudge,rel=1e-3"
    result = run(pytester, refs, f"--gpuregress-inject={fault}")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "lane: exact" in out
    assert "[collective] step0_grad " in out
    corrupted = [line for line in out.splitlines() if "] step0_grad " in line]
    root_group = ("embed_tokens", "lm_head", "model.norm")
    assert corrupted and all(any(name in line for name in root_group) for line in corrupted), corrupted
    assert "elements differ" in out and "worst entries" in out
    assert "nothing in the stack fingerprint changed" in out
    assert "--gpuregress-record" in out
    # The fault's own arithmetic is not a kernel of the stack: an unchanged stack changed none (it once read
    # "aten::ne: its own kernel -> to", and triage quoted it as evidence).
    assert "kernels: the same as in the reference" in out and "kernels changed: 0" in out, out[-3000:]


def test_a_clip_off_by_1e3_is_caught_in_the_tolerant_lane_and_named_the_optimizer(pytester: pytest.Pytester,
                                                                                   refs: Path) -> None:
    # The tiny Llama's gradient norm starts near 0.9, above fsdp's grad_clip of 0.5: step 0 clips. Its loss and
    # gradients before clipping are computed before the clip, so the first signal is the norm after it.
    result = run(pytester, refs, "--gpuregress-inject=clip:mode=scale,rel=1e-3", "--gpuregress-lane=tolerant")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]optimizer[]] clipped_grad_norm: first differing step 0 of 8*the gradients before "
                                 "clipping match at step 0, so the clipping itself scaled them wrongly*"
                                 "AdamW implementation: fused*"])
    assert "[kernel]" not in result.stdout.str() and "[collective]" not in result.stdout.str()


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_legitimate_kernel_drift_shows_in_the_exact_lane(pytester: pytest.Pytester, refs: Path) -> None:
    # That it passes the tolerant lane is shown at full length, against the shipped reference and its
    # envelope (test_shipped_references.py); a changed learning rate is in test_triage.py.
    exact = run(pytester, refs, "--gpuregress-inject=linear_noise:rel=1e-7")
    exact.assert_outcomes(failed=1)
    exact.stdout.fnmatch_lines(["*lane: exact*", "*[[]kernel[]] step0_grad*"])
    assert "kernels: the same as in the reference" in exact.stdout.str()  # the emulated drift is not a kernel change


def test_missing_reference_fails_with_the_record_command(pytester: pytest.Pytester, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run(pytester, empty)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        f"*MissingReference: {empty}/fsdp/cpu-gloo-w2-fp32: no reference recorded*",
        "*fix: record one on a known-good stack: pytest --gpuregress --gpuregress-record 'gpuregress::fsdp[*]' "
        f"--gpuregress-reference-dir={empty} --gpuregress-steps=8*",
    ])
    assert not any(empty.iterdir())  # a comparing run never writes
    # The printed command selects the cases that record that reference, and nothing else.
    command = printed_command(result.stdout.str(), "record one on a known-good stack: ")
    assert collected(pytester, command) == ["gpuregress::fsdp", "gpuregress::fsdp-resume", "gpuregress::fsdp-bf16"]


def test_a_reference_dir_that_does_not_exist_is_a_usage_error_when_comparing(pytester: pytest.Pytester,
                                                                             tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={nowhere}",
                                "-k", FSDP_ONLY, "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--gpuregress-reference-dir={nowhere}: {nowhere} does not exist, and a comparing "
                                 "run only reads references*"])
    assert not nowhere.exists()
    header = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={tmp_path}",
                                "-k", FSDP_ONLY, "--collect-only")
    assert "else shipped" not in header.stdout.str()  # an explicit folder is the only one read


def test_corrupt_reference_names_the_file(pytester: pytest.Pytester, refs: Path) -> None:
    tensors = refs / "fsdp" / "cpu-gloo-w2-fp32" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    result = run(pytester, refs)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*CorruptReference: {tensors}: sha256 * does not match manifest.json*"])


def test_a_reference_of_other_steps_is_a_usage_error_before_any_rank_starts(pytester: pytest.Pytester,
                                                                            refs: Path) -> None:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpuregress", "--gpuregress-steps=6",
                                           f"--gpuregress-reference-dir={refs}", "-k", FSDP_ONLY)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*recorded with other settings, so nothing was trained*",
                                 f"*{refs}*fsdp*record.json was recorded with steps 8 (this run 6): compare with it "
                                 "by adding --gpuregress-steps=8",
                                 "*second choice*--gpuregress-record 'gpuregress::fsdp[*]' "
                                 "--gpuregress-reference-dir=*-this-stack --gpuregress-steps=6*"])
    output = result.stdout.str() + result.stderr.str()
    assert "process group ready" not in output and "gpuregress fsdp: step" not in output  # no rank started
    # Both printed fixes select the case: the first adds the reference's settings, the second records elsewhere.
    first = ["--gpuregress", "--gpuregress-steps=8", f"--gpuregress-reference-dir={refs}", "-k", FSDP_ONLY]
    assert collected(pytester, ["pytest", *first]) == ["gpuregress::fsdp"]
    assert "gpuregress::fsdp" in collected(pytester, printed_command(result.stderr.str(), "in a folder of their own: "))


def test_a_reference_of_an_earlier_release_is_a_usage_error_that_says_so(pytester: pytest.Pytester,
                                                                         refs: Path) -> None:
    record = next(refs.glob("fsdp/*/record.json"))
    data = json.loads(record.read_text())
    data["format"] = "gpuregress-record/1"  # an older schema is refused, never read with fallbacks
    _rewrite_with_manifest(record, data)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={STEPS}",
                                           f"--gpuregress-reference-dir={refs}", "-k", FSDP_ONLY)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{record} was recorded in format 'gpuregress-record/1', and this "
                                 "pytest-gpuregress reads 'gpuregress-record/2'*--gpuregress-record*"])


def test_a_reference_of_another_config_is_named_after_the_run(pytester: pytest.Pytester, refs: Path) -> None:
    # What no option sets (here the learning rate, as an older plugin version might have recorded it) is found
    # when the run is compared.
    record = next(refs.glob("fsdp/*/record.json"))
    data = json.loads(record.read_text())
    data["config"]["lr"] = 1e-3
    _rewrite_with_manifest(record, data)
    result = run(pytester, refs)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ForeignReference: *record.json: reference was recorded for a different setup*",
                                 "*config lr: reference 0.001, this run 0.003*"])


def _rewrite_with_manifest(record: Path, data: dict) -> None:
    """Rewrite a reference's record.json and its sha256 in manifest.json, as a reference recorded so would be."""
    record.write_text(json.dumps(data))
    manifest_path = record.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["record.json"] = hashlib.sha256(record.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
def test_hung_rank_fails_within_the_timeout_with_rank_step_and_stack(pytester: pytest.Pytester, refs: Path) -> None:
    started = time.monotonic()
    result = run(pytester, refs, "--gpuregress-inject=hang:rank=1,step=2", "--gpuregress-timeout=15")
    elapsed = time.monotonic() - started
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 0 waits in all_gather #* for rank 1; rank 1 stopped outside any collective*",
                                 "*rank 1 hung: still running at the time limit (last progress: step 2 done, loss *)*"])
    assert 'faults/process.py", line' in result.stdout.str()  # the hung rank's own Python stack, where it sleeps
    assert elapsed < 15 + 30, elapsed


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
def test_rank_that_raises_reports_its_traceback(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, "--gpuregress-inject=crash:rank=1,step=1")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1 raised RuntimeError (last progress: step 1 done, loss *)*",
                                 "*RuntimeError: injected crash*"])


@pytest.mark.full_tier  # 21 s; a raising rank stays fast: the fast tier stays within its time
def test_rank_killed_before_delivering_fails_with_its_signal(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, "--gpuregress-inject=crash:rank=1,step=1,how=abort")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*rank 1 died with SIGABRT before delivering results (last progress: step 1 done, loss *)*"])


@pytest.mark.full_tier  # 29 s: the fast tier stays within its time
def test_abort_at_teardown_after_delivery_is_harmless(pytester: pytest.Pytester, refs: Path) -> None:
    result = run(pytester, refs, "--gpuregress-inject=teardown_abort:rank=1")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*note: rank 1 delivered its results, then exited with SIGABRT during teardown (ignored)*"])


USER_SCENARIO = '''
import numpy as np
import torch
import torch.distributed as dist

from pytest_gpuregress.reference.record import RunRecord


def train(ctx):
    """A user's own loop: plain DDP-style data parallel linear regression."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=ctx.config.get("lr", 0.1))
    losses = []
    for step in range(ctx.config["steps"]):
        x = torch.arange(8.0).reshape(2, 4) / 8 + ctx.rank
        loss = (model(x) - 1).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / ctx.world_size)
        ctx.step_done(step)
    return RunRecord(scenario="user-linear", config=dict(ctx.config), platform_key="", world_size=ctx.world_size,
                     series={"loss": losses})
'''

USER_TEST = '''
from pytest_gpuregress.launch.net import is_loopback


def test_my_loop(gpuregress):
    record = gpuregress.run("user_scenario:train", config={"steps": 5})
    listening = [a for addrs in record.results["listening"].values() for a in addrs]
    assert listening and all(is_loopback(a) for a in listening), listening
    gpuregress.check(record, name="user-linear")
'''


def test_users_own_training_loop_through_the_fixture(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(user_scenario=USER_SCENARIO, test_user=USER_TEST)
    refs = tmp_path / "user-refs"
    refs.mkdir()
    args = ["-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={refs}", "-k", "my_loop",
            "test_user.py"]
    missing = pytester.runpytest(*args)
    missing.assert_outcomes(failed=1)
    # The printed command names this test by its node id, and records its reference when run as printed.
    command = printed_command(missing.stdout.str(), "record one on a known-good stack: ")
    assert "test_user.py::test_my_loop" in command and "-k" not in command
    pytester.runpytest(*command[1:], "-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert (refs / "user-linear" / "cpu-gloo-w2-fp32" / "manifest.json").is_file()
    compared = pytester.runpytest(*args)
    compared.assert_outcomes(passed=1)
    assert "no case of this configuration reads" not in compared.stdout.str()  # the reference it just read
    broken = pytester.runpytest(*args, "--gpuregress-inject=collective:op=all_reduce,mode=zero_tail,count=1")
    broken.assert_outcomes(failed=1)
    # A user's loop records no step-0 gradients: no evidence separates a kernel from a collective.
    broken.stdout.fnmatch_lines(["*[[]kernel or collective[]] loss: first differing step 0*"])


@pytest.mark.full_tier  # about 20 s; test_torchrun.py runs torchrun agents in the same tier
def test_under_torchrun_every_rank_runs_in_place_and_agrees(recorded: Path, tmp_path: Path) -> None:
    """torchrun sets RANK and WORLD_SIZE: each pytest process is one rank on torchrun's rendezvous."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "pytest",
           "-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={STEPS}",
           f"--gpuregress-reference-dir={recorded}", "-k", FSDP_ONLY]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("fsdp cpu-gloo-w2-fp32: PASSED [exact lane] 8 steps") == 2, done.stdout[-3000:]
    assert "in place under torchrun" in done.stdout
