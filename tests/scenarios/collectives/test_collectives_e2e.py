"""The collective sweep end to end on 2 gloo ranks, with each collective fault class of docs/faults.md.

Sweeps stop at 64 KiB to keep these quick; the default CPU sweep (4 MiB) is timed by
benchmarks/collective_sweep.py instead.
"""

from __future__ import annotations

import re

import pytest

from pytest_gpuregress.scenarios.collectives import plan

pytestmark = pytest.mark.slow
SMALL = "--gpuregress-collectives-max-bytes=64KiB"


def sweep(pytester: pytest.Pytester, selection: str, *faults: str, extra: tuple[str, ...] = ()) -> pytest.RunResult:
    args = ["-p", "no:cacheprovider", "--gpuregress", SMALL, "-k", f"collectives and ({selection})", "-rf", *extra]
    args += [f"--gpuregress-inject={f}" for f in faults]
    return pytester.runpytest(*args)


def failed_ids(result: pytest.RunResult) -> list[str]:
    return re.findall(r"FAILED gpuregress::collectives-(\S+)", result.stdout.str())


def band_table(result: pytest.RunResult) -> dict[str, dict[str, int]]:
    """The summary's failing-cases-by-protocol-and-size-band table, as protocol -> band -> count."""
    lines = result.stdout.str().splitlines()
    start = lines.index("failing cases by protocol and size band:")
    bands = lines[start + 1].split()[1:]
    table: dict[str, dict[str, int]] = {}
    for line in lines[start + 2 :]:
        cells = line.split()
        if len(cells) != len(bands) + 1 or not all(c.isdigit() for c in cells[1:]):
            break
        table[cells[0]] = dict(zip(bands, map(int, cells[1:])))
    return table


def nbytes_of(case_id: str) -> int:
    """Bytes of the larger buffer for a case id on 2 ranks (the fault's size filter uses the same)."""
    op = case_id.split("-")[0]
    n = int(re.search(r"-n(\d+)-", case_id).group(1))  # type: ignore[union-attr]
    dtype = next(d for d in plan.DTYPES if f"-{d}-" in case_id)
    return n * plan.DTYPES[dtype][0] * (1 if op in ("all_reduce", "broadcast") else 2)


def test_clean_sweep_passes(pytester: pytest.Pytester) -> None:
    result = sweep(pytester, "fp32 or bf16 or fp16 or int32")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes["passed"] > 1000
    result.stdout.fnmatch_lines(["*protocol default: * cases on 2 gloo ranks in *s*",
                                 "*all_reduce SUM fp32 bandwidth*", "*algbw(GB/s)*busbw(GB/s)*"])


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_corruption_in_one_size_band_only_is_caught_and_named(pytester: pytest.Pytester) -> None:
    result = sweep(pytester, "fp32", "collective:min_bytes=2048,max_bytes=8192,mode=nudge")
    failed = failed_ids(result)
    assert failed, result.stdout.str()
    assert all(2048 <= nbytes_of(c) <= 8192 for c in failed), failed
    assert {c.split("-")[0] for c in failed} == {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"}
    result.stdout.fnmatch_lines(["*[[]collective[]] all_reduce SUM fp32 n=512 (2 KiB) in place: 6 wrong elements*"
                                 "first wrong index 256 on rank 0*"])
    bands = band_table(result)
    assert bands["default"]["<=64KiB"] == len(failed)  # every failing case sits in that band
    assert all(count == 0 for band, count in bands["default"].items() if band != "<=64KiB"), bands


def test_last_eight_elements_zeroed_for_bf16_avg_is_caught(pytester: pytest.Pytester) -> None:
    result = sweep(pytester, "bf16 and all_reduce", "collective:op=all_reduce,dtype=bf16,reduce_op=avg,mode=zero_tail,count=8")
    failed = failed_ids(result)
    assert failed and all(c.startswith("all_reduce-avg-bf16-") for c in failed), failed
    assert len(failed) == len(plan.sizes(64 << 10, 2, 2))  # every size fails, nothing else does
    result.stdout.fnmatch_lines(["*all_reduce AVG bf16 n=1024 (2 KiB) in place: 48 wrong elements summed over ranks "
                                 "and repeats (48 of them in the last 16), on all 3 repeats; first wrong index 1016*"])


def test_premul_sum_returning_zeros_is_caught(pytester: pytest.Pytester) -> None:
    result = sweep(pytester, "premul_sum", "emulate_premul_sum",
                   "collective:op=all_reduce,reduce_op=premul_sum,mode=zeros")
    failed = failed_ids(result)
    assert failed and all("-premul_sum-" in c for c in failed)
    assert result.parseoutcomes().get("passed", 0) == 0
    result.stdout.fnmatch_lines(["*all_reduce PREMUL_SUM bf16 n=* in place: * wrong elements*got 0.0*"])


def test_premul_sum_is_clean_when_only_emulated(pytester: pytest.Pytester) -> None:
    result = sweep(pytester, "premul_sum and fp32", "emulate_premul_sum")
    assert result.parseoutcomes().get("failed", 0) == 0 and result.parseoutcomes()["passed"] > 10


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes (unit tests stay there)
def test_one_stale_chunk_in_all_gather_is_caught(pytester: pytest.Pytester) -> None:
    result = sweep(pytester, "fp32", "collective:op=all_gather,mode=stale_chunk")
    failed = failed_ids(result)
    assert failed and all(c.startswith("all_gather-") for c in failed), failed
    # the first repeat has no stale buffer to return, so the others fail: reported as intermittent
    result.stdout.fnmatch_lines(["*all_gather(single) fp32 n=1024 (8 KiB) out of place: 4096 wrong elements*"
                                 "on 2 of 3 repeats (intermittent)*"])


def test_fault_that_fires_on_one_call_in_twenty_is_caught(pytester: pytest.Pytester) -> None:
    result = sweep(pytester, "fp32 and all_reduce", "collective:op=all_reduce,every=20,mode=nudge")
    failed = failed_ids(result)
    total = result.parseoutcomes()["passed"] + len(failed)
    # 3 repeats per case, one call in 20 corrupted: about 3/20 of the cases
    assert 0.05 * total < len(failed) < 0.3 * total, (len(failed), total)
    result.stdout.fnmatch_lines(["*on 1 of 3 repeats (intermittent)*"])


def test_protocol_pinning_says_it_does_not_apply_to_gloo(pytester: pytest.Pytester) -> None:
    result = sweep(pytester, "n1 and fp32", extra=("--gpuregress-nccl-protos=LL,LL128,Simple",))
    result.stdout.fnmatch_lines(["*NCCL protocol/algorithm pinning does not apply to gloo*"])
    assert "proto_LL" not in result.stdout.str()


@pytest.mark.full_tier  # 3 and 6 gloo ranks, 20 to 60 s each; NCCL's algorithm is checked fast in test_collectives_plan.py
@pytest.mark.parametrize("world", [3, 6])
def test_average_and_premul_sum_are_exact_at_world_sizes_not_a_power_of_two(pytester: pytest.Pytester, world: int) -> None:
    # The inputs (one contributing rank per element where 1/world is inexact) must be right on gloo at these world
    # sizes as on NCCL (test_collectives_plan.py simulates NCCL's premultiplied average); a lost rank still fails.
    result = sweep(pytester, "avg and (fp32 or bf16 or fp16)", extra=(f"--gpuregress-world-size={world}",
                                                                       "--gpuregress-collectives-max-bytes=4KiB"))
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes["passed"] > 20, result.stdout.str()[-3000:]
    dropped = sweep(pytester, "avg and bf16", "collective:op=all_reduce,reduce_op=avg,mode=zero_tail,count=8",
                    extra=(f"--gpuregress-world-size={world}", "--gpuregress-collectives-max-bytes=4KiB"))
    assert dropped.parseoutcomes().get("failed", 0) > 0


def test_a_bf16_sum_that_truncates_is_caught_by_the_rounding_cases_only(pytester: pytest.Pytester) -> None:
    # A backend whose bf16 SUM rounds toward zero: exact integer sums never round, so the bf16 cases pass; the
    # bf16r cases, whose sums must round to nearest even, fail, every one.
    result = sweep(pytester, "bf16 and sum and not premul_sum", "collective:mode=truncate_bf16")
    rounding = {c.id for c in plan.plan("gloo", 2, 64 << 10) if c.dtype == "bf16r"}
    assert set(failed_ids(result)) == rounding, result.stdout.str()[-3000:]
    assert result.parseoutcomes()["passed"] > 50  # the integer bf16 SUM cases: blind to the rounding mode
    result.stdout.fnmatch_lines(["*[[]collective[]] all_reduce SUM bf16r n=8 (16 B) in place: * wrong elements summed "
                                 "over ranks and repeats*first wrong index 1 on rank 0: expected 16.25, got 16.125*"])


@pytest.mark.parametrize("world", [2, 3])
def test_sums_that_round_are_exact_on_gloo(pytester: pytest.Pytester, world: int) -> None:
    result = sweep(pytester, "bf16r or fp16r", extra=(f"--gpuregress-world-size={world}",))
    outcomes = result.parseoutcomes()
    expected = len([c for c in plan.plan("gloo", world, 64 << 10) if c.dtype in plan.ROUNDING])
    assert outcomes.get("failed", 0) == 0 and outcomes["passed"] == expected, result.stdout.str()[-3000:]


def test_an_op_the_backend_lacks_is_skipped_as_not_supported_never_failed(pytester: pytest.Pytester) -> None:
    """gloo before torch 2.12 raises 'Backend gloo does not support alltoall': a capability, not a wrong number."""
    result = sweep(pytester, "fp32 and all_to_all and n1-", "collective:op=all_to_all,mode=missing", extra=("-rs",))
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("passed", 0) == 0 and outcomes["skipped"] == 2, outcomes
    result.stdout.fnmatch_lines([
        "*links: no case that names its sender ran*",
        "*not supported on this stack (gloo, torch *): all_to_all(list), 1 cases skipped*",
        "*not supported: gloo on torch * lacks all_to_all(list) fp32 n=1 (8 B) out of place: rank 0: RuntimeError: "
        "Backend gloo does not support alltoall. Nothing was computed*"])
    assert "[collective]" not in result.stdout.str()
    assert band_table(result)["default"] == dict.fromkeys(band_table(result)["default"], 0)


KNOWN = """
[[issue]]
id = "this-gloo-sums"
component = "collective"
symptom = "gloo sums wrong"
workaround = "none"
source = "a test"
[issue.affects]
"comm.backend" = "gloo"

[[issue]]
id = "this-torch-fp8"
component = "format"
symptom = "fp8 differs"
workaround = "none"
source = "a test"
[issue.affects]
"comm.backend" = "gloo"
"""


def test_a_failed_case_cites_the_known_issue_of_the_component_it_names(pytester: pytest.Pytester) -> None:
    """The header's KNOWN ISSUE lines match the stack; a failure cites the one of its own component only."""
    pytester.makefile(".toml", known=KNOWN)
    result = sweep(pytester, "fp32 and all_reduce and sum and (n1- or n2-)", "collective:op=all_reduce,mode=nudge,max_bytes=4",
                   extra=("--gpuregress-known-issues=known.toml", "--junitxml=junit.xml"))
    assert failed_ids(result) == ["all_reduce-sum-fp32-n1-inplace"], failed_ids(result)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["gpuregress KNOWN ISSUE this-gloo-sums (collective): gloo sums wrong",
                                 "*gpuregress known issues*",
                                 "this failure names the collective, and this-gloo-sums is a known collective issue*"])
    assert "this-torch-fp8 is a known" not in out and out.count("is a known collective issue") == 1
    junit = (pytester.path / "junit.xml").read_text()
    assert '<property name="known_issues" value="this-gloo-sums" />' in junit


def test_a_training_run_whose_backend_lacks_an_op_is_a_missing_capability_not_a_failure(pytester: pytest.Pytester) -> None:
    """FSDP2's reduce-scatter raising as a backend without it would: the case is skipped as not supported, the
    closing table says NOT SUPPORTED with the backend's words, and no component is blamed."""
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "-rs", "-k", "fsdp and not tiny and not triage "
                                "and not resume and not bf16 and not lora",
                                "--gpuregress-inject=collective:op=reduce_scatter,mode=missing")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([
        "*fsdp cpu-gloo-w2-fp32: NOT SUPPORTED Backend gloo does not support reducescatter*",
        "*not supported: this stack (gloo, torch *) lacks an op fsdp needs, which the reference's stack ran: Backend "
        "gloo does not support reducescatter*"])
    assert "[collective]" not in result.stdout.str()
