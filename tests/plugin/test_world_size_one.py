"""One GPU is honest (issue #22, item 2): at world size 1, what needs peers is skipped or refused, never green.

World size 1 is emulated on the CPU with --gpuregress-world-size=1 (the same platform a one-GPU machine
resolves to, less the device); the "one visible GPU" wording is checked with a patched platform. Every
run here is collection only: nothing trains.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuregress.errors import BadFaultSpec
from pytest_gpuregress.faults import check_ranks, needs_peers, parse
from pytest_gpuregress.scenarios import Launch, Scenario, Setup, registry
from pytest_gpuregress.stack.platforms import Platform, rank_origin, too_few_ranks
from tests.conftest import make_record

ONE_GPU = Platform("cuda", "nccl", 1, "sm_90", "cuda", in_place=False)
CPU_ONE = ("--gpuregress", "--gpuregress-device=cpu", "--gpuregress-world-size=1")
REASON = ("needs 2 or more ranks: this run has 1 (--gpuregress-world-size=1); "
          "collectives, sharding and resharding cannot be exercised")
PEER_CASES = ("sharded or equivalence or (collectives and all_reduce and sum and fp32 and n1024 and inplace)")
PEER_IDS = {"checkpoint-sharded-2to1", "checkpoint-sharded-1to2", "triage-equivalence-fsdp",
            "collectives-all_reduce-sum-fp32-n1024-inplace"}


def _collect(pytester: pytest.Pytester, *args: str) -> dict[str, str | None]:
    """Test id -> its skip reason (None: it would run), after -k, from an in-process --collect-only run."""
    recorder = pytester.inline_run("--collect-only", *args)
    items = recorder.getcall("pytest_collection_finish").session.items  # after -k deselected
    return {item.name: _skip_reason(item) for item in items}


def _skip_reason(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("skip")
    return None if mark is None else mark.kwargs.get("reason")


# --- the wording ---------------------------------------------------------------------------------

def test_the_reason_names_the_ranks_and_why() -> None:
    assert too_few_ranks(2, ONE_GPU) == ("needs 2 or more ranks: this run has 1 (one visible GPU); "
                                         "collectives, sharding and resharding cannot be exercised")
    assert too_few_ranks(1, ONE_GPU) is None
    assert too_few_ranks(2, Platform("cpu", "gloo", 2, "cpu", "cpu", in_place=False)) is None


def test_the_origin_of_the_world_size() -> None:
    assert rank_origin(ONE_GPU) == "one visible GPU"
    assert rank_origin(ONE_GPU, asked=1) == "--gpuregress-world-size=1"
    assert rank_origin(Platform("cuda", "nccl", 1, "sm_90", "cuda", in_place=True)) == "WORLD_SIZE=1 under torchrun"


# --- faults that need peers ------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["collective:op=reduce_scatter,mode=zeros", "emulate_premul_sum",
                                  "checkpoint:mode=rank0_shard", "checkpoint:mode=chunks_permuted",
                                  "lora:mode=rank0_slice"])
def test_a_fault_that_needs_peers_is_refused_at_one_rank(text: str) -> None:
    spec = parse(text)
    assert needs_peers(spec)
    with pytest.raises(BadFaultSpec, match=r"needs 2 or more ranks to fire, and this run has 1 \(one visible GPU\)"):
        check_ranks([spec], 1, "one visible GPU")
    check_ranks([spec], 2)  # two ranks: accepted as before


@pytest.mark.parametrize("text", ["lr_scale", "checkpoint:mode=ulp_nudge", "lora:mode=grad_leak", "crash:rank=0"])
def test_a_fault_of_one_rank_still_runs_at_one_rank(text: str) -> None:
    assert not needs_peers(parse(text))
    check_ranks([parse(text)], 1)


def test_a_collective_inject_on_one_gpu_is_a_usage_error(pytester: pytest.Pytester,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The device-count seam: the session resolves the platform a machine with one visible GPU gives.
    monkeypatch.setattr("pytest_gpuregress.plugin.session.resolve_platform", lambda device, world: ONE_GPU)
    spec = "collective:op=reduce_scatter,mode=zeros"
    result = pytester.runpytest("--gpuregress", "--collect-only", "-q", f"--gpuregress-inject={spec}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --gpuregress-inject: '{spec}': needs 2 or more ranks to fire, and this run "
                                 "has 1 (one visible GPU); run it on a machine with 2+ GPUs or on the CPU (2 gloo ranks)"])


def test_a_collective_inject_at_cpu_world_size_one_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*CPU_ONE, "--collect-only", "-q", "--gpuregress-inject=collective:mode=nudge")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*'collective:mode=nudge': needs 2 or more ranks to fire*(--gpuregress-world-size=1)*"])


# --- cases: skipped with the reason at one rank, unchanged at two -----------------------------------

def test_cases_that_need_peers_are_collected_and_skipped_with_the_reason(pytester: pytest.Pytester) -> None:
    found = _collect(pytester, *CPU_ONE, "-k", PEER_CASES)
    assert set(found) == PEER_IDS
    assert set(found.values()) == {REASON}


def test_single_rank_cases_still_run_at_one_rank(pytester: pytest.Pytester) -> None:
    found = _collect(pytester, *CPU_ONE, "-k", "(fsdp and not equivalence) or full-state-dict or resume")
    assert {"fsdp", "checkpoint-full-state-dict", "checkpoint-resume", "triage-oracle-fsdp"} <= set(found)
    assert not any(found.values())


def test_the_skip_reason_is_reported(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*CPU_ONE, "-rs", "-q", "-k", "sharded")  # skipped before any rank starts
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines([f"SKIPPED [[]2[]] *: {REASON}"])


def test_the_header_says_what_one_rank_cannot_exercise(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*CPU_ONE, "--collect-only", "-k", "sharded")
    result.stdout.fnmatch_lines(["gpuregress single rank (--gpuregress-world-size=1): collectives, sharding and "
                                 "resharding cannot be exercised; * cases that need 2 or more ranks are skipped, "
                                 "and faults that need peers are refused"])


def test_nothing_changes_at_two_cpu_ranks(pytester: pytest.Pytester) -> None:
    found = _collect(pytester, "--gpuregress", "--gpuregress-device=cpu", "-k", PEER_CASES)
    assert set(found) == PEER_IDS
    assert not any(found.values())
    result = pytester.runpytest("--gpuregress", "--gpuregress-device=cpu", "--collect-only", "-k", "sharded",
                                "--gpuregress-inject=collective:op=reduce_scatter,mode=zeros")
    assert result.ret == pytest.ExitCode.OK
    assert "single rank" not in result.stdout.str()


# --- triage at one rank --------------------------------------------------------------------------

def test_triage_equivalence_is_not_applicable_at_one_rank() -> None:
    from pytest_gpuregress import triage

    launched: list[str] = []

    def run(sc: Scenario, launch: Launch) -> Any:
        launched.append(launch.key)
        return make_record(config=launch.config)

    setup = Setup(device_kind="cpu", backend="gloo", world_size=1)
    equivalence, oracle = triage.cheap_evidence(registry()["fsdp"], setup, run)
    assert (equivalence.status, equivalence.convicts) == ("not applicable", False)
    assert oracle.status == "clean"
    assert launched == ["triage-1", "triage-oracle"]  # no N-rank launch that would be one rank again
