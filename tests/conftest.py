"""Shared helpers for the plugin's own tests."""

from __future__ import annotations

import fcntl
import os
import random
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# pytester's inline runs restore sys.modules after each run, and torch's C extension cannot be
# imported a second time in one process: import the heavy modules once, before any inline run.
import ml_dtypes  # noqa: F401,E402 - the formats scenario's; the plugin loads scenarios only inside --gpuregress runs
import numpy as np
import pytest
import safetensors.numpy  # noqa: F401,E402
import torch  # noqa: F401,E402
import torch.distributed  # noqa: F401,E402
import torch.distributed._functional_collectives  # noqa: F401,E402 - registers a torch library: once per process
import transformers  # noqa: F401,E402
import transformers.models.qwen2.modeling_qwen2  # noqa: F401,E402 - the models tests build in-process
import transformers.models.qwen2_moe.modeling_qwen2_moe  # noqa: F401,E402

from pytest_gpuregress.comparison.compare import Comparison, compare_training
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.stack import determinism
from pytest_gpuregress.triage.naming import name_findings


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`pytest --gpuregress` in this checkout is the main job: the built-in suite against the shipped references.
    The files here are the plugin's own tests, run without the flag; a project's tests would be collected too."""
    if config.getoption("gpuregress", default=False) or config.getini("gpuregress"):
        return True
    return None


def compare_named(*args: Any, **kwargs: Any) -> Comparison:
    """compare_training with its findings named by triage (triage/naming.py), as the session reports them."""
    return name_findings(compare_training(*args, **kwargs))


def make_record(steps: int = 5, seed: int = 0, **overrides: object) -> RunRecord:
    """A small synthetic training record, as the fsdp scenario would produce it."""
    rng = np.random.default_rng(seed)
    loss = list(np.linspace(5.5, 3.0, steps) + rng.normal(0, 1e-3, steps))
    record = RunRecord(
        scenario="fsdp",
        config={"steps": steps, "lr": 3e-3, "dtype": "fp32", "model": "tiny-llama"},
        platform_key="cpu-gloo-w2-fp32",
        world_size=2,
        fingerprint={"versions": {"torch": "2.13.0", "python": "3.11.7"}, "device": {"kind": "cpu"},
                     "numerics": {"blas": "mkl"}, "comm": {"backend": "gloo", "world_size": 2}},
        series={"loss": loss, "grad_norm": list(rng.uniform(0.5, 2.0, steps))},
        param_names=["a.weight", "b.weight"],
        arrays={
            "param_grad_norm": rng.uniform(0.1, 1.0, (steps, 2)),
            "step0_grad/a.weight": rng.normal(0, 1, (16, 8)).astype(np.float32),
            "step0_grad/b.weight": rng.normal(0, 1, (32,)).astype(np.float32),
        },
        digests={"a.weight": {"sha256": "aa", "sum": 1.0, "abs_sum": 10.0, "l2": 2.0, "shape": [16, 8], "dtype": "float32"},
                 "b.weight": {"sha256": "bb", "sum": 2.0, "abs_sum": 20.0, "l2": 4.0, "shape": [32], "dtype": "float32"}},
    )
    for key, value in overrides.items():
        setattr(record, key, value)
    return record


@pytest.fixture
def record() -> RunRecord:
    return make_record()


@contextmanager
def gloo_world_of_one(folder: Path) -> Iterator[None]:
    """An in-process gloo world of one rank (a FileStore in ``folder``, no port), for rank code that needs a process
    group: FSDP2's fully_shard, DCP, the trainers. Made and destroyed here, or the one that already exists."""
    import torch.distributed as dist

    if dist.is_initialized():  # a world of one already (a module's one_rank_group): the code runs in it
        assert dist.get_world_size() == 1, "a test left a process group of another size in this process"
        yield
        return
    dist.init_process_group("gloo", store=dist.FileStore(str(folder / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``gloo_world_of_one`` for a test module (its module-scoped fixtures train in it), its store outside any
    test's tmp_path."""
    with gloo_world_of_one(tmp_path_factory.mktemp("store")):
        yield


@pytest.fixture
def kept_generators() -> Iterator[None]:
    """Python's, numpy's and torch's generators put back after a test that seeds, scrambles or restores them."""
    from pytest_gpuregress.training import rng_state

    states = rng_state.capture("cpu")
    yield
    rng_state.restore(states, "cpu")


def record_references(root: Path, *args: str) -> Path:
    """Record references under ``root/refs`` through the real command line; ``args`` select and size the run."""
    refs = root / "refs"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "--gpuregress-record",
           f"--gpuregress-reference-dir={refs}", *args]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return refs


FSDP_STEPS = "8"
# The fsdp case alone: tests/triage/test_triage.py runs the triage cases, tests/scenarios/fsdp/test_fsdp_resume_e2e.py the
# resume case.
FSDP_ONLY = "fsdp and not triage and not resume and not bf16"


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reference for the fsdp scenario at 8 steps, recorded once per test run through the real command line.

    Under xdist the workers share one recording (the first to take the lock records it, in the folder above
    the workers' own): on two cores a second recording cost the README's test command about 20 seconds.
    Tests read it and never change it; ``refs`` gives a private copy."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.mktemp("fsdp-reference")
    else:
        shared = tmp_path_factory.getbasetemp().parent / "fsdp-reference"
        shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        refs = shared / "refs"
        if not (shared / "recorded").is_file():
            shutil.rmtree(refs, ignore_errors=True)  # a worker that failed halfway left a partial one
            record_references(shared, f"--gpuregress-steps={FSDP_STEPS}", "-k", FSDP_ONLY)
            (shared / "recorded").touch()
    assert (refs / "fsdp" / "cpu-gloo-w2-fp32" / "manifest.json").is_file()
    return refs


@pytest.fixture
def refs(recorded: Path, tmp_path: Path) -> Path:
    """A private copy of the module's ``recorded`` references, for tests that damage or extend them."""
    copy = tmp_path / "refs"
    shutil.copytree(recorded, copy)
    return copy


def records_passes_and_breaks(run: Callable[..., pytest.RunResult], args: list[str], refs: Path, name: str,
                              fault: str, caught: list[str], steps: int = 20) -> None:
    """The life of a user's reference through ``run`` (a pytester runner): record it, compare a clean run in
    the exact lane, then see ``fault`` fail it with the ``caught`` lines."""
    run(*args, "--gpuregress-record").assert_outcomes(passed=1)
    assert (refs / name / "cpu-gloo-w2-fp32" / "manifest.json").is_file()
    clean = run(*args)
    clean.assert_outcomes(passed=1)
    clean.stdout.fnmatch_lines([f"{name} cpu-gloo-w2-fp32: PASSED [[]exact lane[]] {steps} steps*"])
    broken = run(*args, f"--gpuregress-inject={fault}")
    broken.assert_outcomes(failed=1)
    broken.stdout.fnmatch_lines([f"*scenario '{name}' on cpu-gloo-w2-fp32 differs from its reference*", *caught])


def summary_of(output: str, prefix: str) -> str:
    """A case's summary in the closing section: its line starting with ``prefix`` and the indented detail lines
    under it, joined by " | "."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        block.append(line.strip())
    return " | ".join(block)


def reproduced(output: str) -> list[int]:
    """Run every ``gpuregress compare`` command a pytester run printed to reproduce its verdicts (in this process);
    their exit codes, one per failure."""
    from pytest_gpuregress.cli import main

    commands = {line.split(": ", 1)[1] for line in output.splitlines()
                if line.startswith(("reproduce the verdict: gpuregress compare", "reproduce the comparison: gpuregress compare"))}
    assert commands, "no reproduce command printed"
    return [main(shlex.split(command)[1:]) for command in sorted(commands)]


def printed_command(output: str, after: str) -> list[str]:
    """The pytest command a run printed right after ``after`` (up to the line's end or a following ")"), split."""
    line = next(line for line in output.splitlines() if after in line)
    command = line.split(after, 1)[1].split(")", 1)[0]
    assert command.startswith("pytest --gpuregress"), command
    return shlex.split(command)


def collected(pytester: pytest.Pytester, command: list[str]) -> list[str]:
    """The node ids a printed ``pytest ...`` command selects, run with --collect-only where pytest ran."""
    assert command[0] == "pytest"
    result = pytester.runpytest(*command[1:], "--collect-only", "-q", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-2000:] + result.stderr.str()[-2000:]
    return listed(result)


def listed(result: pytest.RunResult) -> list[str]:
    """The node ids a --collect-only -q run listed."""
    return [line for line in result.outlines if "::" in line and " " not in line]


def kept_run_passes(artifacts: Path, name: str, platform: str, reference: Path | None = None) -> int:
    """``gpuregress compare [REF] RUN`` on a run kept with --gpuregress-keep-runs (artifacts/runs/name/platform)."""
    from pytest_gpuregress.cli import main

    run = artifacts / "runs" / name / platform
    assert (run / "manifest.json").is_file(), f"no kept run at {run}"
    return main(["compare", *([str(reference)] if reference is not None else []), str(run)])


# The longest files first. Under the README's command (pytest -n 2 --dist loadfile) pytest-xdist 3.5+
# sends the files with the most tests first and uses this order only among files of equal counts:
# measured, keeping this order throughout (--no-loadscope-reorder) was slower (13m59s against 13m01s),
# since two long multi-rank files side by side contend for the 2 cores more than a long and a quick one.
LONGEST_FIRST = ("test_shipped_references.py", "test_main_job.py", "test_worker_pool.py", "test_training_e2e.py",
                 "test_torchrun.py", "test_triage.py", "test_checkpoint_e2e.py", "test_user_models.py",
                 "test_scenario_plugins.py", "test_kernels_perf_e2e.py", "test_lora_e2e.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


# The process-wide variables set_determinism may set (torch_state removes them).
DETERMINISM_ENV = ("CUBLAS_WORKSPACE_CONFIG", "ROCBLAS_DEFAULT_ATOMICS_MODE", determinism.MODE_VARIABLE)


def sdpa_switches() -> dict[str, bool]:
    return {b: getattr(torch.backends.cuda, f"{b}_sdp_enabled")() for b in determinism.SDPA_BACKENDS}


@pytest.fixture
def torch_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """set_determinism changes process-wide state: every piece of it is put back after each test."""
    for name in DETERMINISM_ENV:
        monkeypatch.delenv(name, raising=False)  # and removed again if set_determinism sets it
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: None)  # no CUDA to seed on a CPU build
    saved: dict[str, Any] = {
        "threads": torch.get_num_threads(), "det": torch.are_deterministic_algorithms_enabled(),
        "warn": torch.is_deterministic_algorithms_warn_only_enabled(), "sdpa": sdpa_switches(),
        "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32),
        "tf32": torch.backends.cuda.matmul.allow_tf32, "precision": torch.get_float32_matmul_precision(),
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()),
    }
    yield
    torch.set_num_threads(saved["threads"])
    torch.use_deterministic_algorithms(saved["det"], warn_only=saved["warn"])
    for backend, on in saved["sdpa"].items():
        getattr(torch.backends.cuda, f"enable_{backend}_sdp")(on)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = saved["cudnn"]
    torch.backends.cuda.matmul.allow_tf32 = saved["tf32"]
    torch.set_float32_matmul_precision(saved["precision"])
    torch.set_rng_state(saved["rng"][0])
    random.setstate(saved["rng"][1])
    np.random.set_state(saved["rng"][2])
