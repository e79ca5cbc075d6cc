"""Every expectation of benchmarks/gpu_check.sh, matched on the CPU against what a GPU run would print or record.

The records and outputs here are GPU-shaped and made by the plugin's own code: inventories that
training/kernels.py takes from CUDA-shaped profiler events (aten dispatch above device kernels), a host-op watch
on an accelerator, a cuda fingerprint printed by ``gpuregress env``, NCCL protocol summaries. An expectation
that cannot match on a GPU fails here, before the one GPU run a task may get is spent on it."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_gpuregress.evidence import kernels
from pytest_gpuregress.scenarios import registry
from pytest_gpuregress.scenarios.base import Setup
from pytest_gpuregress.scenarios.collectives import plan
from pytest_gpuregress.stack.platforms import resolve_platform
from pytest_gpuregress.training.kernels import inventory_from_events
from pytest_gpuregress.triage.naming import described

from .conftest import make_record
from .stack.test_gpu_branches import as_gpu_build

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check_expect.py"
_spec = importlib.util.spec_from_file_location("gpu_check_expect", SCRIPT)
expect = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_check_expect", expect)  # its dataclasses look their module up there
_spec.loader.exec_module(expect)  # type: ignore[union-attr]

FLASH_KERNEL = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, cutlass::bfloat16_t>"
MATH_KERNELS = ["ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "void at::native::cunn_SoftMaxForward<8>"]


def event(name: str, children: tuple[Any, ...] = (), kernels: tuple[str, ...] = ()) -> SimpleNamespace:
    """A profiler function event as torch.profiler gives it on CUDA: its aten children and its device kernels."""
    node = SimpleNamespace(name=name, cpu_children=list(children), cpu_parent=None,
                           kernels=[SimpleNamespace(name=k) for k in kernels])
    for child in children:
        child.cpu_parent = node
    return node


def flatten(events: list[SimpleNamespace]) -> list[SimpleNamespace]:
    return [e for top in events for e in (top, *flatten(top.cpu_children))]


def gpu_inventory(sdpa_backend: str) -> dict[str, Any]:
    """The kernel inventory training/kernels.py takes from an H100's profiler events: SDPA through its backend's
    aten op down to the device kernels, a linear through matmul to a GEMM kernel."""
    if sdpa_backend == "flash":
        sdpa = event(expect.SDPA_OP, (event("aten::_fused_sdp_choice"),
                                      event("aten::_scaled_dot_product_flash_attention",
                                            (event("aten::_flash_attention_forward", kernels=(FLASH_KERNEL,)),))))
    else:
        sdpa = event(expect.SDPA_OP, (event("aten::_fused_sdp_choice"),
                                      event("aten::_scaled_dot_product_attention_math",
                                            (event("aten::bmm", kernels=MATH_KERNELS[:1]),
                                             event("aten::_softmax", kernels=MATH_KERNELS[1:])))))
    linear = event("aten::linear", (event("aten::t"), event("aten::matmul", (event("aten::mm", kernels=MATH_KERNELS[:1]),))))
    return inventory_from_events(flatten([sdpa, linear]))


def gpu_record(sdpa_backend: str = "math", host_ops: dict[str, Any] | None = None) -> dict[str, Any]:
    results = {"kernels": gpu_inventory(sdpa_backend), "host_ops": {"accelerator": "cuda", "ops": host_ops or {}}}
    return {"results": results}


def found(pattern: str, output: str) -> bool:
    """What the script's step() does: grep -E over the whole log, line by line."""
    return any(re.search(pattern, line) for line in output.splitlines())


# --- the text expectations, each against GPU-shaped output ----------------------------------------------------

def test_every_step_has_an_expectation_for_both_modes_and_the_script_reads_them_all() -> None:
    script = (SCRIPT.parent / "gpu_check.sh").read_text()
    for step in expect.TEXT:
        assert expect.text(step, "gpu") and expect.text(step, "dry") and expect.text(step, "gpu-w1")
        assert f"$(expect {step})" in script, f"gpu_check.sh writes its own expectation for {step!r}"
    assert not re.search(r"step \S+ \S+ '[^']+' --", script), "a step with an inline regex, not one from gpu_check_expect.py"


def test_env_on_a_gpu_prints_the_cuda_kind(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from pytest_gpuregress import cli
    from pytest_gpuregress.stack import fingerprint

    as_gpu_build(monkeypatch, count=8)
    monkeypatch.setattr(fingerprint, "collect", lambda kind, backend, world: {
        "device": {"kind": kind, "name": "NVIDIA H200", "count": world}, "comm": {"backend": backend}})
    assert cli.main(["env", "--json", "--device", "cuda"]) == 0
    assert found(expect.text("env", "gpu"), capsys.readouterr().out)


@pytest.mark.parametrize("hip", [None, "6.4.43482"])
def test_the_platform_key_of_a_gpu_machine_matches(monkeypatch: pytest.MonkeyPatch, hip: str | None) -> None:
    as_gpu_build(monkeypatch, hip=hip, count=1)
    platform = resolve_platform("cuda")
    fsdp = registry()["fsdp"]
    key = platform.key(fsdp.platform_tag(fsdp.default_config(Setup(platform.device_kind, platform.backend, 1, steps=100))))
    assert found(expect.text("platform-key", "gpu"), key) and "-w1-" in key
    assert not found(expect.text("platform-key", "dry"), key)


def test_the_forced_flash_backend_on_a_gpu_is_a_kernel_change_the_step_sees() -> None:
    clean, forced = make_record(), make_record()
    clean.results, forced.results = gpu_record("math")["results"], gpu_record("flash")["results"]
    report = "\n".join(kernels.report_lines(kernels.changes(clean, forced), "--gpuregress-kernel-changes=fail"))
    assert found(expect.text("sdpa-backend", "gpu"), report)
    # What the old regex asked of the text: on a GPU the arrow is followed by device kernels, so it never matched.
    assert not found("attention: .*-> _scaled_dot_product_flash_attention([^_]|$)", report)


def test_a_gpu_host_fallback_report_names_the_op() -> None:
    record = make_record()
    record.results = gpu_record(host_ops={"aten::silu": {"calls": 12, "shape": [48, 256, 2048], "dtype": "bfloat16"}})["results"]
    assert found(expect.text("host-op", "gpu"), "\n".join(map(described, kernels.host_op_problems(record))))


def sweep_result(case: plan.Case, wrong: int = 0) -> dict[str, Any]:
    """One case's merged result as the sweep's ranks report it (plan.merge_results)."""
    return {"case": case.to_json(), "nbytes": case.nbytes(8), "wrong": wrong, "tail_wrong": wrong,
            "bad_repeats": 1 if wrong else 0, "repeats": 3, "time_s": 1e-4, "error": None,
            "first": {"index": case.n - 1, "rank": 3, "expected": 4.0, "got": 0.0} if wrong else None}


def test_the_nccl_protocol_summary_names_ll128() -> None:
    collectives = registry()["collectives"]
    case = plan.Case(op="all_reduce", variant="", reduce_op="sum", dtype="bf16", n=1024, in_place=True, protocol="LL128")
    record = make_record()
    record.results = {"cases": {case.id: sweep_result(case)}}
    record.timings = {"launch_wall_s": 3.0}
    lines = collectives.summary({"LL128": record}, Setup("cuda", "nccl", 8))
    assert found(expect.text("protocols", "gpu"), "\n".join(lines))
    assert not found(expect.text("protocols", "dry"), "\n".join(lines))


def test_a_wrong_collective_is_reported_in_the_words_the_fault_step_expects() -> None:
    case = plan.Case(op="all_reduce", variant="", reduce_op="avg", dtype="bf16", n=1024, in_place=True)
    problem = plan.problem(case, sweep_result(case, wrong=8), 8)
    assert problem and found(expect.text("collective-fault", "gpu"), problem)


# --- the structured expectations ------------------------------------------------------------------------------

def test_the_forced_backend_is_read_from_a_gpu_records_dispatch() -> None:
    assert expect.sdpa_forced_problems(gpu_record("flash")["results"], "gpu") == []
    assert expect.sdpa_forced_problems(gpu_record("math")["results"], "gpu") != []
    assert expect.sdpa_forced_problems(gpu_record("flash")["results"], "gpu-w1") == []


def test_a_clean_gpu_inventory_passes_and_a_host_op_or_another_backend_fails() -> None:
    assert expect.inventory_problems(gpu_record("math")["results"], "gpu") == []
    host = gpu_record("math", {"aten::silu": {"calls": 1, "shape": [64, 64], "dtype": "bfloat16"}})["results"]
    assert any("host ops" in p for p in expect.inventory_problems(host, "gpu"))
    assert any("dispatched" in p for p in expect.inventory_problems(gpu_record("flash")["results"], "gpu"))
    # A CPU record has no host-op watch; as a GPU record that is wrong, so the check can fail.
    cpu = {"kernels": {expect.SDPA_OP: {"dispatch": ["aten::_scaled_dot_product_flash_attention_for_cpu"], "kernels": []}},
           "host_ops": None}
    assert expect.inventory_problems(cpu, "dry") == [] and expect.inventory_problems(cpu, "gpu") != []


def test_the_command_line_reads_a_record_and_exits_by_its_verdict(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(gpu_record("flash")))
    bad.write_text(json.dumps(gpu_record("math")))
    run = [sys.executable, str(SCRIPT), "sdpa-forced", "gpu"]
    assert subprocess.run([*run, str(good)], capture_output=True).returncode == 0
    out = subprocess.run([*run, str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and "not /" in out.stdout
    missing = subprocess.run([*run, str(tmp_path / "none.json")], capture_output=True, text=True)
    assert missing.returncode != 0 and "no record at" in missing.stderr


# --- the GPU budget ---------------------------------------------------------------------------------------------

def test_the_budget_estimate_covers_every_step_of_the_script_and_one_gpu_fits() -> None:
    from .test_gpu_check_dry_run import STEPS

    script = (SCRIPT.parent / "gpu_check.sh").read_text()
    steps, replicas, budget = (int(re.search(rf"\b{name}=\$?\{{?(?:GPU_CHECK_BUDGET:-)?(\d+)", script).group(1))  # type: ignore[union-attr]
                               for name in ("GPU_STEPS", "GPU_REPLICAS", "GPU_BUDGET"))
    assert tuple(expect.gpu_launches(steps, replicas, one_gpu=True)) == STEPS
    lines, fits = expect.budget_lines(steps, replicas, one_gpu=True, budget_s=budget)
    assert fits, "\n".join(lines)  # the run gpu_check.sh makes on one H200, every launch and pytest session counted
    # Every launch counts: one more replica, or a longer run, costs time, and a budget too small says so.
    one_more = expect.budget_lines(100, 4, one_gpu=True, budget_s=480)[0][0]
    seconds = [float(re.search(r": (\d+) s of", line).group(1))  # type: ignore[union-attr]
               for line in (expect.budget_lines(100, 3, one_gpu=True, budget_s=480)[0][0], one_more)]
    assert seconds[1] > seconds[0]
    assert not expect.budget_lines(100, 3, one_gpu=True, budget_s=60)[1]
    # A lease of 15 minutes holds the machine's start, the transfers and one rerun beside it: at most 360 s.
    assert budget <= 360
    # Step 0's trace digests count for every launch that traces it: the recording's own run, not its replicas.
    launched = expect.gpu_launches(steps, replicas, one_gpu=True)
    assert launched["record"].traced == 1 and launched["compare"].traced == 1
    assert expect.COSTS_S["trace_digests"] > 0
    # On one GPU nothing that needs peers runs: no sweep, no equivalence (triage's one-rank run beside the recording).
    assert launched["protocols"].sweeps == 0 and launched["record"].models == 1 + replicas + 1
    assert expect.gpu_launches(100, 3, one_gpu=False)["protocols"].sweeps == 3
