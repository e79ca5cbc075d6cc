"""Where each fault acts (faults/reach.py): the table in docs/faults.md, the skip of cases no fault
reaches, and, in the full tier, rows of the table measured for real (benchmarks/fault_reach.py)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from pytest_gpuregress.faults import KINDS, parse, reach

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- fault-reach:begin -->", "<!-- fault-reach:end -->"


def test_the_docs_table_is_the_declared_one() -> None:
    text = (REPO / "docs" / "faults.md").read_text()
    shown = text[text.index(BEGIN) + len(BEGIN): text.index(END)].strip().splitlines()
    assert shown == reach.table_lines(), "regenerate with: python -c 'from pytest_gpuregress.faults import reach; " \
                                         "print(chr(10).join(reach.table_lines()))'"


def test_every_fault_kind_and_mode_has_a_row() -> None:
    for kind in KINDS.values():
        assert kind.name in reach.REACH or any(k.startswith(kind.name + ":") for k in reach.REACH), kind.name
    for mode in KINDS["checkpoint"].params["mode"].choices:
        assert f"checkpoint:{mode}" in reach.REACH


def test_a_case_no_injected_fault_reaches_is_skipped_with_the_reason() -> None:
    why = reach.unreached_reason(["format:mode=keep_0x80"], "fsdp", "")
    assert why == ("--gpuregress-inject format:mode=keep_0x80: no injected fault acts in fsdp; it acts in formats; "
                   "docs/faults.md lists where each fault acts")
    assert reach.unreached_reason(["format:mode=keep_0x80"], "formats", "io-dcp") is None
    assert reach.unreached_reason([], "fsdp", "") is None  # nothing injected: every case runs
    portability = reach.unreached_reason(["collective:op=all_reduce"], "checkpoint", "portability")
    assert portability is not None and "inference from the shipped bundle on 1 rank" in portability


def test_a_collective_fault_reaches_only_sweep_cases_of_its_ops() -> None:
    spec = parse("collective:op=reduce_scatter,mode=nudge")
    assert reach.reaches(spec, "collectives-reduce_scatter-single-sum-fp32-n4096-outofplace")
    assert not reach.reaches(spec, "collectives-all_reduce-sum-fp32-n1-inplace")
    assert reach.reaches(parse("collective:mode=zeros"), "collectives-all_reduce-sum-fp32-n1-inplace")
    assert reach.reaching(["lr_scale", "collective:op=all_reduce"], "collectives", ["all_reduce-sum-fp32-n1-inplace"]) \
        == ["collective:op=all_reduce"]


def test_a_users_own_scenario_is_reached_by_every_fault() -> None:
    assert reach.reaching(["format:mode=keep_0x80", "lr_scale"], "my_loop", []) == ["format:mode=keep_0x80", "lr_scale"]


def test_an_unreached_case_is_skipped_end_to_end_and_a_reached_one_catches_the_fault(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "-k", "fsdp or formats-inspect", "-rfs",
                                "--gpuregress-inject=format:mode=keep_0x80")
    result.assert_outcomes(failed=1, skipped=5)  # fsdp, fsdp-resume, fsdp-bf16, the two triage cases: no format fault
    result.stdout.fnmatch_lines(["*not applicable: --gpuregress-inject format:mode=keep_0x80: no injected fault acts "
                                 "in fsdp; it acts in formats; docs/faults.md lists where each fault acts*"])
    result.stdout.fnmatch_lines(["FAILED *formats-inspect*"])


def _benchmark() -> object:
    path = REPO / "benchmarks" / "fault_reach.py"
    spec = importlib.util.spec_from_file_location("fault_reach", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_reach"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.full_tier
@pytest.mark.parametrize("fault", ["checkpoint:mode=untied", "lora:mode=merge_ulp"])
def test_measured_rows_match_the_table(fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's measurement of one row, over the scenario the fault belongs to: 'fires' exactly where the
    table says so, and 0 (a failure saying the fault never fired) everywhere else."""
    bench = _benchmark()
    # The fault's own scenario: lora, checkpoint. Not lora's resume cases: against the benchmark's empty reference
    # folder they have no checkpoint to resume (their column is declared, as fsdp-resume's).
    scenario = fault.split(":")[0]
    monkeypatch.setattr(bench, "SELECTION", f"{scenario} and not resume" if scenario == "lora" else scenario)
    cells = bench.measure(fault, 4, tmp_path)  # type: ignore[attr-defined]
    declared = reach.REACH[reach.key_of(parse(fault))]
    for test_id, cell in cells.items():
        column = reach.column_of(test_id)
        assert column is not None, test_id
        expected_fires = column in declared
        assert cell.startswith("fires") == expected_fires, (test_id, cell, declared)
        assert re.fullmatch(r"fires \d+|0", cell), cell


def test_a_loader_fault_reaches_only_the_io_cases_of_its_loader() -> None:
    dcp = parse("format:mode=loader_fn_as_fnuz,path=dcp")
    assert reach.reaches(dcp, "formats-io-dcp") and not reach.reaches(dcp, "formats-io-safe_open")
    assert not reach.reaches(dcp, "formats-decode-e4m3fn")
    torch_load = parse("format:mode=loader_fn_as_fnuz,path=torch_load")
    assert reach.reaches(torch_load, "formats-io-dcp")  # DCP reads its files with torch.load
    every = parse("format:mode=loader_fn_as_fnuz")
    assert all(reach.reaches(every, f"formats-io-{p}") for p in ("safetensors", "safe_open", "torch_load", "dcp",
                                                                  "transformers"))
    assert reach.reaches(parse("format:mode=fn_as_fnuz"), "formats-decode-e4m3fn")
    e5m2 = parse("format:mode=loader_e5m2_as_e4m3fn")  # transformers' fine-grained fp8 is e4m3fn only
    assert all(reach.reaches(e5m2, f"formats-io-{p}") for p in ("safetensors", "safe_open", "torch_load", "dcp"))
    assert not reach.reaches(e5m2, "formats-io-transformers")
    assert not reach.reaches(parse("format:mode=loader_e5m2_as_e4m3fn,path=safe_open"), "formats-io-transformers")
    assert "e4m3fn only" in reach.unreached_reason(["format:mode=loader_e5m2_as_e4m3fn"], "formats", "io-transformers")


def test_consensus_is_reached_by_the_faults_its_workloads_run_into() -> None:
    assert reach.reaches(parse("matmul_ulp:rank=1"), "consensus-devices")
    assert not reach.reaches(parse("matmul_ulp:rank=1"), "consensus-links")  # the link sweep runs no matmul
    assert reach.reaches(parse("collective:op=all_gather,mode=nudge,rel=1e-3"), "consensus-links")
    assert not reach.reaches(parse("collective:op=reduce_scatter,mode=nudge,rel=1e-3"), "consensus-links")


def test_a_truncating_bf16_reduction_reaches_the_sweeps_reductions_and_the_bf16_lane() -> None:
    truncate = parse("collective:mode=truncate_bf16")
    assert reach.key_of(truncate) == "collective:truncate_bf16"
    assert reach.reaches(truncate, "collectives-all_reduce-sum-bf16r-n8-inplace")
    assert reach.reaches(truncate, "collectives-proto_LL-reduce_scatter-single-sum-bf16r-n8-outofplace")
    assert not reach.reaches(truncate, "collectives-all_gather-single-bf16-n8-outofplace")
    assert not reach.reaches(parse("collective:op=all_gather|all_reduce,mode=truncate_bf16"),
                             "collectives-reduce_scatter-list-sum-bf16r-n8-outofplace")
    assert not reach.reaches(truncate, "fsdp") and not reach.reaches(truncate, "consensus-links")
    assert reach.reaches(truncate, "fsdp-bf16")  # the CPU bf16 lane reduce-scatters its gradients in bf16 (AVG)


def test_a_truncating_cast_reaches_the_bf16_lane_on_a_cpu_and_every_bf16_training_case_on_gpus() -> None:
    cast = parse("cast:mode=truncate_bf16")
    assert reach.reaches(cast, "fsdp-bf16", "cpu") and not reach.reaches(cast, "fsdp", "cpu")
    assert reach.reaches(cast, "fsdp", "cuda") and reach.reaches(cast, "lora-fully_shard", "cuda")
    assert not reach.reaches(cast, "checkpoint-resume", "cuda") and not reach.reaches(cast, "collectives", "cpu")
    assert "trains in fp32" in reach.unreached_reason(["cast:mode=truncate_bf16"], "fsdp", "fsdp", "cpu")
