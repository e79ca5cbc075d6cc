"""Where each fault acts (faults/reach.py): the table in docs/faults.md, the skip of cases no fault
reaches, and, in the full tier, rows of the table measured for real (benchmarks/fault_reach.py)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from pytest_gpuregress import activities as act
from pytest_gpuregress.faults import ACTS_ON, KINDS, parse, reach
from pytest_gpuregress.scenarios import Case
from pytest_gpuregress.scenarios.collectives import exercised as sweep_case

REPO = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- fault-reach:begin -->", "<!-- fault-reach:end -->"
CATALOGUE = {"cpu": reach.catalogue("cpu"), "cuda": reach.catalogue("cuda")}


def reaches(text: str, test_id: str, device_kind: str = "cpu") -> bool:
    """Whether the fault ``text`` reaches the built-in case ``test_id`` of a 2-rank run on ``device_kind``."""
    return reach.reaches(parse(text), CATALOGUE[device_kind][test_id])


def why_skipped(texts: list[str], test_id: str, device_kind: str = "cpu") -> str | None:
    cases = CATALOGUE[device_kind]
    return reach.unreached_reason(texts, cases[test_id], test_id, cases.items)


def test_the_docs_table_is_the_declared_one() -> None:
    text = (REPO / "docs" / "faults.md").read_text()
    shown = text[text.index(BEGIN) + len(BEGIN): text.index(END)].strip().splitlines()
    assert shown == reach.table_lines(), "regenerate with: python -c 'from pytest_gpuregress.faults import reach; " \
                                         "print(chr(10).join(reach.table_lines()))'"


def test_every_fault_kind_and_mode_declares_what_it_acts_on() -> None:
    for kind in KINDS.values():
        assert kind.name in ACTS_ON or any(k.startswith(kind.name + ":") for k in ACTS_ON), kind.name
    for mode in KINDS["checkpoint"].params["mode"].choices:
        assert f"checkpoint:{mode}" in ACTS_ON
    # and every activity a fault acts on is run by some built-in case (with a tied model of the zoo given): a fault
    # that reaches nothing is a typo
    from pytest_gpuregress.scenarios import Setup, registry
    from pytest_gpuregress.training.model_specs import parse_model

    tied = Setup("cpu", "gloo", 2, models=(parse_model("tiny-llama-tied", REPO),))
    cases = [*(c for catalogue in CATALOGUE.values() for c in catalogue.values()),
             *(c for sc in registry().values() for c in sc.cases(tied))]
    runs = {a for case in cases if case.exercises is not None for a in case.exercises.does}
    for key in ACTS_ON:
        assert act.meets(reach.activities_of(key), runs), key


def test_every_built_in_case_declares_what_it_exercises() -> None:
    """A built-in case without a declaration would count as reached by every fault (a plug-in's does)."""
    from pytest_gpuregress.option_spec import BUILTIN_SCENARIO_OPTIONS
    from pytest_gpuregress.scenarios import Setup, registry
    from pytest_gpuregress.training.model_specs import parse_model

    options = {spec.dest: spec.default for spec in BUILTIN_SCENARIO_OPTIONS} | {"gpuregress_consensus": True}
    builtin = [sc for sc in registry().values() if type(sc).__module__.startswith("pytest_gpuregress.")]
    for device_kind, backend in (("cpu", "gloo"), ("cuda", "nccl")):
        for world_size in (1, 2, 8):
            setup = Setup(device_kind, backend, world_size, options=options,  # type: ignore[arg-type]
                          models=(parse_model("tiny-moe", REPO),))
            undeclared = [(sc.name, c.id) for sc in builtin for c in sc.cases(setup) if c.exercises is None]
            assert undeclared == [], (device_kind, world_size)


def test_a_case_no_injected_fault_reaches_is_skipped_with_the_reason() -> None:
    why = why_skipped(["format:mode=keep_0x80"], "fsdp")
    fault, _, said = why.partition(": ")
    assert fault == "--gpuregress-inject format:mode=keep_0x80"
    where, acts, pointer = said.split("; ")
    assert (where, acts) == ("no injected fault acts in fsdp", "it acts in formats")
    assert pointer.startswith("docs/faults.md lists")
    assert why_skipped(["format:mode=keep_0x80"], "formats-io-dcp") is None
    assert why_skipped([], "fsdp") is None  # nothing injected: every case runs
    portability = why_skipped(["collective:op=all_reduce"], "checkpoint-portability")
    assert portability is not None and "shipped bundle on 1 rank" in portability
    assert "no collective)" in portability  # what the collective fault needs and the case lacks


def test_a_plug_ins_case_that_declares_nothing_is_reached_by_every_fault() -> None:
    assert reach.reaches(parse("format:mode=keep_0x80"), Case("my_loop"))
    assert reach.reaching(["format:mode=keep_0x80", "lr_scale"], [Case("my_loop")]) == ["format:mode=keep_0x80",
                                                                                        "lr_scale"]


def test_a_collective_fault_reaches_only_sweep_cases_of_its_ops() -> None:
    nudge = "collective:op=reduce_scatter,mode=nudge"
    assert reaches(nudge, "collectives-reduce_scatter-single-sum-fp32-n4096-outofplace")
    assert not reaches(nudge, "collectives-all_reduce-sum-fp32-n1-inplace")
    assert reaches("collective:mode=zeros", "collectives-all_reduce-sum-fp32-n1-inplace")
    one = CATALOGUE["cpu"]["collectives-all_reduce-sum-fp32-n1-inplace"]
    assert reach.reaching(["lr_scale", "collective:op=all_reduce"], [one]) == ["collective:op=all_reduce"]
    # on a CPU accelerate runs DDP: all_reduce and broadcast; on GPUs FSDP2 and every op
    assert not reaches("collective:op=reduce_scatter", "lora-accelerate") and reaches("collective:op=broadcast",
                                                                                     "lora-accelerate")
    assert reaches("collective:op=reduce_scatter", "lora-accelerate", "cuda")


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
    for test_id, cell in cells.items():
        expected_fires = reaches(fault, test_id)
        assert cell.startswith("fires") == expected_fires, (test_id, cell)
        assert re.fullmatch(r"fires \d+|0", cell), cell


def test_a_loader_fault_reaches_only_the_io_cases_of_its_loader() -> None:
    dcp = "format:mode=loader_fn_as_fnuz,path=dcp"
    assert reaches(dcp, "formats-io-dcp") and not reaches(dcp, "formats-io-safe_open")
    assert not reaches(dcp, "formats-decode-e4m3fn")
    torch_load = "format:mode=loader_fn_as_fnuz,path=torch_load"
    assert reaches(torch_load, "formats-io-dcp")  # DCP reads its files with torch.load
    every = "format:mode=loader_fn_as_fnuz"
    assert all(reaches(every, f"formats-io-{p}") for p in ("safetensors", "safe_open", "torch_load", "dcp",
                                                                  "transformers"))
    assert reaches("format:mode=fn_as_fnuz", "formats-decode-e4m3fn")
    e5m2 = "format:mode=loader_e5m2_as_e4m3fn"  # transformers' fine-grained fp8 is e4m3fn only
    assert all(reaches(e5m2, f"formats-io-{p}") for p in ("safetensors", "safe_open", "torch_load", "dcp"))
    assert not reaches(e5m2, "formats-io-transformers")
    assert not reaches("format:mode=loader_e5m2_as_e4m3fn,path=safe_open", "formats-io-transformers")
    assert "e4m3fn only" in why_skipped(["format:mode=loader_e5m2_as_e4m3fn"], "formats-io-transformers")


def test_consensus_is_reached_by_the_faults_its_workloads_run_into() -> None:
    assert reaches("matmul_ulp:rank=1", "consensus-devices")
    assert not reaches("matmul_ulp:rank=1", "consensus-links")  # the link sweep runs no matmul
    assert reaches("collective:op=all_gather,mode=nudge,rel=1e-3", "consensus-links")
    assert not reaches("collective:op=reduce_scatter,mode=nudge,rel=1e-3", "consensus-links")


def test_a_truncating_bf16_reduction_reaches_the_sweeps_reductions_and_the_bf16_lane() -> None:
    truncate = "collective:mode=truncate_bf16"
    assert reach.reaches(parse(truncate), Case("x", exercises=sweep_case("reduce_scatter")))  # a protocol's case too
    assert reaches(truncate, "collectives-all_reduce-sum-bf16r-n8-inplace")
    assert not reaches(truncate, "collectives-all_gather-single-bf16-n8-outofplace")
    assert not reaches("collective:op=all_gather|all_reduce,mode=truncate_bf16",
                       "collectives-reduce_scatter-list-sum-bf16r-n8-outofplace")
    assert not reaches(truncate, "fsdp") and not reaches(truncate, "consensus-links")
    assert reaches(truncate, "fsdp-bf16")  # the CPU bf16 lane reduce-scatters its gradients in bf16 (AVG)


def test_a_truncating_cast_reaches_the_bf16_lane_on_a_cpu_and_every_bf16_training_case_on_gpus() -> None:
    cast = "cast:mode=truncate_bf16"
    assert reaches(cast, "fsdp-bf16", "cpu") and not reaches(cast, "fsdp", "cpu")
    assert reaches(cast, "fsdp", "cuda") and reaches(cast, "lora-fully_shard", "cuda")
    assert not reaches(cast, "checkpoint-resume", "cuda")
    assert not reaches(cast, "collectives-all_reduce-sum-fp32-n1-inplace")
    assert "trains in fp32" in why_skipped(["cast:mode=truncate_bf16"], "fsdp")


def test_a_new_built_in_scenario_brings_its_column_without_an_edit_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy declares what its one case exercises; the table, the skips and the reasons follow from that."""
    from pytest_gpuregress.scenarios import Scenario, Setup, registry

    class Toy(Scenario):
        name = "toy"
        rank_entry = "toy.rank:run"

        def cases(self, setup: Setup) -> list[Case]:
            return [Case("toy", exercises=act.exercises(act.STEP, act.collective("all_reduce"),
                                                        summary="a two-layer MLP's steps, no model forward"))]

    scenarios = {**registry(), "toy": Toy()}
    monkeypatch.setattr(reach, "registry", lambda: scenarios)
    table = reach.table_lines()
    def cells_of(row: str) -> list[str]:
        return [cell.strip() for cell in row.strip("|").split("|")]

    column = cells_of(table[0]).index("`toy`")
    cells = {cells_of(row)[0].strip("`"): cells_of(row)[column] for row in table[2:]}
    assert cells["lr_scale"] == "acts" and cells["collective"] == "acts" and cells["format"] == "n/a"
    toy = reach.catalogue("cpu")["toy"]
    assert not reach.reaches(parse("collective:op=reduce_scatter"), toy)
    assert "a two-layer MLP's steps" in (reach.unreached_reason(["sdpa_backend"], toy, "toy") or "")


def test_a_users_model_case_exercises_what_its_config_says() -> None:
    """The Llama family's forward and tied embeddings come from the model, not from the tiny Llama's cases: a
    transformers rope fault skips a Qwen2-MoE's cases instead of failing them 'fired 0 times'."""
    from pytest_gpuregress.scenarios import Setup, registry
    from pytest_gpuregress.training.model_specs import parse_model

    models = tuple(parse_model(name, REPO) for name in ("tiny-moe", "tiny-llama-tied"))
    setup = Setup("cpu", "gloo", 2, models=models)
    cases = {f"{sc.name}-{c.id}": c for sc in registry().values() for c in sc.cases(setup)}
    rope, untied = parse("library:mode=rope_interleaved"), parse("library:mode=untied")
    assert not reach.reaches(rope, cases["fsdp-tiny-moe"]) and reach.reaches(rope, cases["fsdp-tiny-llama-tied"])
    assert reach.reaches(untied, cases["fsdp-tiny-llama-tied"]) and not reach.reaches(untied, cases["fsdp-fsdp"])
    assert not reach.reaches(untied, cases["fsdp-tiny-moe"])
    tied_key = parse("checkpoint:mode=tied_key_dropped")
    assert reach.reaches(tied_key, cases["checkpoint-full-state-dict-tiny-llama-tied"])
    assert not reach.reaches(tied_key, cases["checkpoint-full-state-dict-tiny-moe"])
    assert not reach.reaches(tied_key, cases["checkpoint-sharded-2to1-tiny-llama-tied"])
