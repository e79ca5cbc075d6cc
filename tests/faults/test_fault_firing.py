"""A fault that did not fire fails (issue #23, item 2): counters per installed spec, summed over ranks and
launches, in the notes and the report; a case whose fault fired zero times fails with the path it missed."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_gpuregress import faults
from pytest_gpuregress.faults import firing, parse
from pytest_gpuregress.faults.firing import Firing
from pytest_gpuregress.plugin.launches import count_faults as _count_faults

from ..conftest import FSDP_ONLY, make_record

NEVER = "collective:op=all_reduce,min_bytes=1e12"  # the fsdp case all-reduces nothing near a terabyte
NUDGE = "linear_noise:rel=1e-6"  # every F.linear; the run's own checks (a collective's invariants) leave it be


def test_a_counter_counts_and_a_rank_reports_only_what_it_can_count() -> None:
    first, twice, uncounted = Firing("lr_scale"), Firing("lr_scale"), Firing("teardown_abort", counted=False)
    first.fire()
    twice.fire(2)
    assert firing.rank_counts([first, twice, uncounted]) == {"lr_scale": 3}  # the same spec twice sums


def test_counts_merge_over_ranks_and_every_fault_gets_a_note() -> None:
    texts = ["collective:op=all_reduce,ranks=1", "slow_step:rank=0", "emulate_premul_sum", "teardown_abort:rank=1"]
    per_rank = [{texts[0]: 0, texts[1]: 4, texts[2]: 3}, {texts[0]: 5, texts[2]: 3}]
    counts = firing.by_rank(texts, per_rank)
    assert counts == {texts[0]: [0, 5], texts[1]: [4, 0], texts[2]: [3, 3]}  # teardown_abort: nothing counted it
    assert firing.notes(texts, counts) == [
        "fault injected: collective:op=all_reduce,ranks=1 (fired 5 times (rank 0: 0, rank 1: 5))",
        "fault injected: slow_step:rank=0 (fired 4 times (rank 0: 4, rank 1: 0))",
        "fault injected: emulate_premul_sum (acted 6 times (rank 0: 3, rank 1: 3); a shim that gives gloo PREMUL_SUM, "
        "not a fault: it corrupts nothing)",
        "fault injected: teardown_abort:rank=1 (not counted: it acts at teardown, after the results are delivered, "
        "so no record can count it)"]
    record = make_record()
    _count_faults(record, texts, [make_record(results={firing.RESULT_KEY: c}) for c in per_rank])
    assert record.results[firing.RESULT_KEY] == {texts[0]: 5, texts[1]: 4, texts[2]: 6}
    assert record.notes == firing.notes(texts, counts)


def test_a_fault_that_fired_nowhere_is_named_with_the_path_it_missed() -> None:
    # Summed over the launches of one case: fired in one launch is fired.
    launches = [{firing.RESULT_KEY: {NEVER: 0, NUDGE: 0, "emulate_premul_sum": 0}}, {firing.RESULT_KEY: {NUDGE: 7}}, {}]
    assert firing.totals(launches) == {NEVER: 0, NUDGE: 7, "emulate_premul_sum": 0}
    assert firing.unfired(launches) == [  # a shim need not fire
        f"[fault] '{NEVER}' fired 0 times in this run: the run never reached the path it corrupts (no all_reduce call of "
        "at least 1e+12 bytes between 2 or more ranks), so this case proves nothing about it; choose a fault that applies "
        "to this case (docs/faults.md)"]


@pytest.mark.parametrize(("spec", "path"), [
    ("collective:op=reduce_scatter|all_gather,max_bytes=4096,dtype=bf16,ranks=1,every=3",
     "no all_gather/reduce_scatter call of at most 4096 bytes in bfloat16 on rank 1 between 2 or more ranks "
     "(it fires on 1 matching call in 3)"),
    ("crash:rank=1,step=100", "step 100 never completed"),
    ("host_op", "no torch.nn.functional.silu call"),
    ("checkpoint:mode=ulp_nudge,layer=0,proj=down_proj", "no load of model.layers.0.*.down_proj.weight (hooks.after_load)"),
    ("lora:mode=rank0_slice", "no sharded adapter gathered for saving: adapter_io.gather_for_save under fully_shard, "
                              "Accelerator.get_state_dict of a sharded model under accelerate (on a CPU accelerate "
                              "runs DDP, whose whole tensors have no slice to lose: use lora-fully_shard there)"),
    ("format:mode=flip_overflow,format=e5m2", "no overflowing cast to e5m2 (device.cast)"),
])
def test_the_path_a_fault_missed_reads_its_spec(spec: str, path: str) -> None:
    assert firing.path(parse(spec)) == path


def test_installed_faults_count_only_when_they_act() -> None:
    import torch

    ctx = SimpleNamespace(rank=0, world_size=2, device_kind="cpu", cleanup_hooks=[], step_hooks=[], teardown_hooks=[])
    installed = faults.install_counted(["lr_scale:factor=2", "crash:step=3", "teardown_abort", "linear_noise:rank=1"], ctx)
    try:
        assert [f.spec for f in installed] == ["lr_scale:factor=2", "crash:step=3", "teardown_abort"]  # rank 0 only
        weight = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        weight.grad = torch.ones(2)
        optimizer.step()
        optimizer.step()
        for step in (1, 2):
            for hook in ctx.step_hooks:
                hook(0, step)
        assert firing.rank_counts(installed) == {"lr_scale:factor=2": 2, "crash:step=3": 0}  # step 3 never came
        with pytest.raises(RuntimeError, match="injected crash"):
            ctx.step_hooks[0](0, 3)
        assert installed[1].count == 1  # counted before it acted
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()


def test_an_empty_collective_output_is_not_counted_as_corrupted() -> None:
    import torch

    from pytest_gpuregress.faults.collective import CollectiveFault

    fault = CollectiveFault(parse("collective:op=all_reduce"), rank=0, world_size=2)
    fault.after("all_reduce", 0, torch.ones(0), None)
    assert fault.fired == 0
    fault.after("all_reduce", 16, torch.ones(4), None)
    assert fault.fired == fault.firing.count == 1


# --- end to end: the fsdp case, 4 steps, on 2 gloo ranks ----------------------------------------------

def run(pytester: pytest.Pytester, refs: Path, *extra: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "--gpuregress-steps=4", "--gpuregress-replicas=0",
                              f"--gpuregress-reference-dir={refs}", "-k", FSDP_ONLY, *extra)


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
@pytest.mark.slow
def test_a_fault_that_cannot_fire_on_the_case_fails_it_and_one_that_fires_is_counted(pytester: pytest.Pytester,
                                                                                   tmp_path: Path) -> None:
    refs, junit = tmp_path / "refs", tmp_path / "junit.xml"
    # A reference recorded with a fault that fires says so, with its counts on each rank.
    recorded = run(pytester, refs, "--gpuregress-record", f"--gpuregress-inject={NUDGE}")
    recorded.assert_outcomes(passed=1)
    recorded.stdout.fnmatch_lines([f"*note: fault injected: {NUDGE} (fired * times (rank 0: *, rank 1: *))"])
    # The same fault again matches that reference; a second one that never fires fails the case on its own.
    result = run(pytester, refs, f"--gpuregress-inject={NUDGE}", f"--gpuregress-inject={NEVER}", f"--junitxml={junit}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        f"*[[]fault[]] '{NEVER}' fired 0 times in this run: the run never reached the path it corrupts (no all_reduce "
        "call of at least 1e+12 bytes between 2 or more ranks), so this case proves nothing about it*",
        "*(the comparison with the reference * passed)*"])
    result.stdout.fnmatch_lines([f"*note: fault injected: {NUDGE} (fired * times*",
                                 f"*note: fault injected: {NEVER} (fired 0 times (rank 0: 0, rank 1: 0))"])
    fired = next(p.get("value") for p in ET.parse(junit).iter("property") if p.get("name") == "faults_fired")
    assert f"{NEVER}: 0" in fired and f"{NUDGE}: " in fired
    # Never recorded: a run whose fault never fired is no reference of that fault.
    refused = run(pytester, tmp_path / "new-refs", "--gpuregress-record", f"--gpuregress-inject={NEVER}")
    refused.assert_outcomes(failed=1)
    refused.stdout.fnmatch_lines(["*not recording 'fsdp': the run fails its own checks*", f"*'{NEVER}' fired 0 times*"])
    assert not (tmp_path / "new-refs" / "fsdp").exists()
