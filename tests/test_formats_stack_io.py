"""The formats scenario's io cases: the quantized checkpoints through the stack's own loaders and writers.

A misread placed inside each real loader (safetensors' load_file and safe_open, torch.load, DCP,
transformers' from_pretrained) must be caught and named with both formats and the factor; a clean
stack passes every path; a known failure of the installed library is reported by name while the
other paths still run; an unknown one fails its path."""

from __future__ import annotations

import tempfile
import types
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuregress import faults
from pytest_gpuregress.errors import NotApplicable
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.base import Case, Setup
from pytest_gpuregress.scenarios.formats import SCENARIO, judge, known_issues, roundtrip, stack_io
from pytest_gpuregress.scenarios.formats.catalog import IO_PATHS, SCHEMES

pytestmark = pytest.mark.cpu_sensitive  # .ci/run runs these again on a lower CPU kernel path

CONFIG = {"model": "tiny-llama", "model_size": "cpu", "seed": 0, "batch": [2, 16]}
E4M3FN = ["per_tensor_e4m3fn"]


def io_results(paths: list[str], schemes: list[str] = E4M3FN, *specs: str) -> tuple[dict[str, Any], list[int]]:
    """(stack_io results per path, how often each fault fired), one rank in this process."""
    ctx = types.SimpleNamespace(cleanup_hooks=[], rank=0)
    firings = faults.install_counted(list(specs), ctx)
    try:
        *_, io = roundtrip.run(schemes, CONFIG, "cpu", Path(tempfile.mkdtemp()), lambda label: None, paths)
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()
    return io, [f.count for f in firings]


def verdict(path: str, io: dict[str, Any]) -> list[str]:
    record = RunRecord(scenario="formats", config={}, platform_key="", world_size=1, results={"io": io})
    return SCENARIO.verdict(Case(f"io-{path}", data={"part": "io", "path": path}), record, Setup("cpu", "gloo", 1))


def test_every_path_reads_and_writes_every_scheme_byte_for_byte_on_a_clean_stack() -> None:
    io, _ = io_results(list(IO_PATHS), list(SCHEMES))
    for path in IO_PATHS:
        assert io[path]["problems"] == [], path
        assert io[path]["checked"] > 0, path
        assert verdict(path, io) == [] or path == "transformers"  # transformers may skip on an old version
    # Every scheme goes through the generic paths: 5 schemes of 17 weights, 1 probe, with scales and amax.
    assert io["torch_load"]["checked"] >= 5 * 18 * 2


@pytest.mark.parametrize("path", IO_PATHS)
def test_a_fn_to_fnuz_misread_inside_each_real_loader_is_caught_and_named(path: str) -> None:
    spec = f"format:mode=loader_fn_as_fnuz,path={path}"
    io, fired = io_results([path], E4M3FN, spec)
    assert fired[0] > 0  # the fault sat in the loader the path really called
    problems = verdict(path, io)
    assert problems, io[path]
    text = problems[0]
    assert text.startswith(f"[checkpoint I/O] {path} (")
    assert "e4m3fn" in text and "e4m3fnuz" in text and "factor 2" in text
    assert "0x80 -> 0x00 rewrite" in text  # the fix


def test_a_misread_in_torch_load_shows_through_dcp_which_loads_with_it() -> None:
    io, fired = io_results(["dcp"], E4M3FN, "format:mode=loader_fn_as_fnuz,path=torch_load")
    assert fired[0] > 0
    [problem] = io["dcp"]["problems"]
    assert "values read back 0.5x (factor 2)" in problem


def test_a_known_failure_of_the_installed_loader_is_named_and_the_other_paths_still_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors raising KeyError on the F8_E8M0 tag it writes (the MX schemes' scales), as reported with
    a torch that has no float8_e8m0fnu: a known issue by name, a warning, and the other paths go on."""
    import safetensors.torch

    real = safetensors.torch.load_file

    def no_e8m0(filename: str, device: str = "cpu") -> dict[str, Any]:
        if "mx_" in Path(filename).name:
            raise KeyError("F8_E8M0")
        return real(filename, device=device)

    monkeypatch.setattr(safetensors.torch, "load_file", no_e8m0)
    io, _ = io_results(["safetensors", "torch_load"], ["per_tensor_e4m3fn", "mx_fp8_e4m3fn"])
    assert io["safetensors"]["problems"] == []
    [issue] = io["safetensors"]["known_issues"]
    assert "mx_fp8_e4m3fn: load_file: known issue safetensors-e8m0-keyerror of safetensors" in issue
    assert io["safetensors"]["checked"] > 0 and io["torch_load"]["checked"] > 0  # the rest still ran
    with pytest.warns(judge.KnownStackIssue, match="safetensors-e8m0-keyerror"):
        assert verdict("safetensors", io) == []


def test_an_unknown_failure_of_a_loader_fails_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("storage is corrupt")

    monkeypatch.setattr(torch, "load", broken)
    io, _ = io_results(["torch_load"])
    assert verdict("torch_load", io) == [
        "[checkpoint I/O] torch_load (torch " + io["torch_load"]["library"].split()[-1] + "): per_tensor_e4m3fn: "
        "torch.load raised RuntimeError: storage is corrupt"]


def test_a_path_that_compared_nothing_fails_and_one_that_could_not_run_is_skipped_with_the_reason() -> None:
    empty = {"library": "torch 2.13.0", "problems": [], "known_issues": [], "checked": 0, "skipped": None}
    assert "the path was not exercised" in verdict("dcp", {"dcp": empty})[0]
    with pytest.raises(NotApplicable, match="io-transformers: transformers 4.45.0 cannot load fp8"):
        verdict("transformers", {"transformers": {**empty, "skipped": "transformers 4.45.0 cannot load fp8 here"}})


def test_known_issues_match_by_library_call_and_symptom() -> None:
    fp4 = "RuntimeError: shape '[256, 64]' is invalid for input of size 8192"
    assert known_issues.match("safetensors", "get_slice", fp4).name == "safetensors-f4-safe-open"
    assert known_issues.match("safetensors", "load_file", fp4) is None  # load_file reads it: a new failure
    assert known_issues.match("torch", "get_slice", fp4) is None
    assert known_issues.match("safetensors", "save_file", "KeyError: torch.float8_e4m3fnuz").name == "safetensors-no-fnuz"


def test_the_fault_and_the_scenario_name_the_same_paths() -> None:
    from pytest_gpuregress.faults import KINDS
    from pytest_gpuregress.faults.loaders import TARGETS

    assert tuple(TARGETS) == IO_PATHS == tuple(stack_io.PATHS)
    assert KINDS["format"].params["path"].choices == IO_PATHS
