"""The checkpoint scenario's verdicts on synthetic records: torch-free, milliseconds.

Each detector is shown silent on a clean record and firing, with the piece of state named, on a
record that carries the difference its fault would leave.
"""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

from pytest_gpuregress import fault_points, faults
from pytest_gpuregress.faults import checkpoint as checkpoint_faults
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.base import Setup
from pytest_gpuregress.scenarios.checkpoint import checks, plan
from pytest_gpuregress.scenarios.shared.state_pieces import differing, merge_boundaries


def hashes(**overrides: list[str]) -> dict[str, dict[str, dict[str, object]]]:
    """Full-tensor hashes of two parameters, each cut into two chunks; ``overrides``: chunks by parameter."""
    chunks = {"embed": ["e0", "e1"], "norm": ["n0", "n1"], **overrides}
    return {piece: {name: {"sha256": "".join(parts), "shape": [4, 2], "chunks": list(parts)}
                    for name, parts in chunks.items()}
            for piece in ("model", "optimizer.exp_avg")}


# What a reshard finding says, field by field: the piece and tensor, its shape, the two world sizes, and why.
RESHARD = re.compile(r"(?P<piece>\S+) of (?P<name>\w+) (?P<shape>\[[\d, ]+\]): the full-tensor hash differs after "
                     r"saving at world size (?P<n>\d+) and loading at (?P<m>\d+); (?P<why>.+)")
PERMUTED = re.compile(r"its (?P<chunks>\d+) chunks along dim 0 come back in the order (?P<order>\[[\d, ]+\]): chunks "
                      r"permuted when resharding (?P<n>\d+) -> (?P<m>\d+)")


NOT_RESTORED = re.compile(r"(?P<piece>\S+) after the load is not the saved state \((?P<why>.+)\)")


def not_restored(findings: list[str]) -> list[tuple[str, str]]:
    """(piece, how it differs) of each finding that says a piece of state was not restored."""
    return [(m["piece"], m["why"]) for m in map(NOT_RESTORED.fullmatch, findings) if m]


def reshard_facts(found: list[str]) -> list[dict[str, str]]:
    """Each finding's fields, read back with RESHARD (a finding of another form fails the test)."""
    matched = [RESHARD.fullmatch(line) for line in found]
    assert all(matched), found
    return [m.groupdict() for m in matched if m]


def test_reshard_of_unchanged_tensors_is_silent() -> None:
    assert checks.reshard_findings(hashes(), hashes(), 2, 1) == []


def test_reshard_names_chunks_that_come_back_permuted() -> None:
    assert checks._permutation(["e0", "e1"], ["e1", "e0"]) == [1, 0]
    found = checks.reshard_findings(hashes(), hashes(embed=["e1", "e0"]), 2, 1)
    facts = reshard_facts(found)
    assert [(f["piece"], f["name"], f["shape"], f["n"], f["m"]) for f in facts] == \
        [("model", "embed", "[4, 2]", "2", "1"), ("optimizer.exp_avg", "embed", "[4, 2]", "2", "1")]
    whys = [PERMUTED.fullmatch(f["why"]) for f in facts]
    assert all(w is not None and w.groupdict() == {"chunks": "2", "order": "[1, 0]", "n": "2", "m": "1"} for w in whys)


def test_reshard_names_a_chunk_that_changed_and_a_piece_that_is_gone() -> None:
    loaded = hashes(norm=["n0", "zz"])
    del loaded["optimizer.exp_avg"]["embed"]
    found = checks.reshard_findings(hashes(), loaded, 1, 2)
    assert checks._permutation(["n0", "n1"], ["n0", "zz"]) is None  # another chunk, not the saved ones reordered
    missing = [line for line in found if not RESHARD.fullmatch(line)]
    assert [line.split(" is missing ") for line in missing] == [["optimizer.exp_avg of embed", "after the load"]]
    changed = reshard_facts([line for line in found if line not in missing])
    assert [f["piece"] for f in changed] == ["model", "optimizer.exp_avg"]
    assert all({**f, "piece": ""} == {"piece": "", "name": "norm", "shape": "[4, 2]", "n": "1", "m": "2",
                                      "why": "1 of its 2 chunks along dim 0 differ"} for f in changed)


def sha(tag: str) -> str:
    return (tag * 32)[:64]  # as long as a sha256: the messages name the item, not the digest


def boundary(**changes: dict[str, str]) -> dict[str, dict[str, str]]:
    state = {"model": {"embed": sha("m1"), "norm": sha("m2")}, "optimizer.exp_avg": {"embed": sha("a1"), "norm": sha("a2")},
             "optimizer.step": {"embed": "5.0", "norm": "5.0"}, "lr_scheduler": {"state": sha("s")},
             "rng.python": {"rank0": sha("p0"), "rank1": sha("p1")}, "rng.numpy": {"rank0": sha("q0"), "rank1": sha("q1")},
             "data.position": {"position": "5"}}
    state.update(changes)
    return state


def records(loaded: dict[str, dict[str, str]], resumed_tail: list[float] | None = None,
            deterministic: bool = True) -> tuple[RunRecord, RunRecord, RunRecord]:
    losses = [5.0, 4.9, 4.8, 4.7, 4.6, 4.5]
    straight = RunRecord("checkpoint", {}, "p", 2, series={"loss": losses},
                         results={"boundary": boundary(), "deterministic": deterministic})
    first = RunRecord("checkpoint", {}, "p", 2, series={"loss": losses[:3]}, results={"boundary": boundary()})
    second = RunRecord("checkpoint", {}, "p", 2, series={"loss": resumed_tail or losses[3:]},
                       results={"boundary": loaded})
    return straight, first, second


def test_a_resume_that_restores_everything_passes() -> None:
    assert checks.resume_findings(*records(boundary()), k=3) == ([], [])


def test_an_unrestored_generator_is_named_with_its_ranks_and_the_first_resumed_step() -> None:
    loaded = boundary(**{"rng.numpy": {"rank0": sha("x0"), "rank1": sha("x1")}})
    straight, first, second = records(loaded, [4.71, 4.6, 4.5])
    why = "2 of 2 ranks differ, first rank0"
    assert differing(boundary(), loaded) == [("rng.numpy", why)]
    assert checks.first_curve_difference(straight.series["loss"], [*first.series["loss"], *second.series["loss"]],
                                         exact=True) == 3
    findings, table = checks.resume_findings(straight, first, second, k=3)
    assert not_restored(findings[:1]) == [("rng.numpy", why)] and len(not_restored(findings)) == 1
    assert findings[1].startswith("loss curve: ") and " from step 3 " in findings[1]
    assert "(the first step after the resume)" in findings[1]
    assert "expected 4.7, got 4.71 " in findings[1]
    rows = {line.split()[0]: line for line in table[2:]}
    assert rows["rng.numpy"].endswith(f"DIFFERS: {why}")
    assert all(rows[p].endswith("same") for p in rows if p != "rng.numpy")


def test_a_dropped_optimizer_state_shows_its_step_count() -> None:
    loaded = boundary(**{"optimizer.step": {"embed": "1.0", "norm": "1.0"}})
    expected = [("optimizer.step", "2 of 2 tensors differ, first embed: 5.0 -> 1.0")]
    assert differing(boundary(), loaded) == expected
    findings, _ = checks.resume_findings(*records(loaded), k=3)
    assert len(findings) == 1 and not_restored(findings) == expected


def test_a_data_position_not_restored_is_named() -> None:
    loaded = boundary(**{"data.position": {"position": "0"}})
    expected = [("data.position", "1 of 1 entries differ, first position: 5 -> 0")]
    assert differing(boundary(), loaded) == expected
    findings, _ = checks.resume_findings(*records(loaded), k=3)
    assert len(findings) == 1 and not_restored(findings) == expected


def test_curves_are_bitwise_on_a_deterministic_stack_and_within_tolerance_elsewhere() -> None:
    drift = [4.7 * (1 + 1e-8), 4.6, 4.5]
    assert checks.resume_findings(*records(boundary(), drift, deterministic=False), k=3) == ([], [])
    losses = records(boundary(), drift)[0].series["loss"]
    assert checks.first_curve_difference(losses, [*losses[:3], *drift], exact=True) == 3
    assert checks.first_curve_difference(losses, [*losses[:3], *drift], exact=False) is None
    findings, _ = checks.resume_findings(*records(boundary(), drift, deterministic=True), k=3)
    assert findings[0].startswith("loss curve: ") and " from step 3 " in findings[0]
    assert "bitwise (a deterministic stack)" in findings[0]


def test_a_failed_load_is_one_finding() -> None:
    straight, first, second = records(boundary())
    second.results = {"load_error": "/x/tensors/__1_0.distcp: missing"}
    assert checks.resume_findings(straight, first, second, 3) == (
        ["loading the checkpoint in new processes failed: /x/tensors/__1_0.distcp: missing"], [])


def test_every_rank_contributes_its_generators_to_the_boundary() -> None:
    ranks = [{"model": {"a": "1"}, "rng.python": {"rank0": "p0"}}, {"model": {"a": "other"}, "rng.python": {"rank1": "p1"}}]
    assert merge_boundaries(ranks) == {"model": {"a": "1"}, "rng.python": {"rank0": "p0", "rank1": "p1"}}


def test_numerics_equal_but_for_collectives_is_the_same_stack_for_a_checkpoint() -> None:
    base = {"versions": {"torch": "2.13.0"}, "device": {"kind": "cpu"}, "numerics": {}, "comm": {"world_size": 2}}
    one_rank = copy.deepcopy(base)
    one_rank["comm"]["world_size"] = 1
    other_torch = copy.deepcopy(base)
    other_torch["versions"]["torch"] = "2.14.1"
    assert checks.same_numerics(base, one_rank)
    assert not checks.same_numerics(base, other_torch)


def test_cases_reshard_both_ways_on_two_ranks_and_more_ways_on_eight() -> None:
    ids = [c.id for c in plan.cases(Setup("cpu", "gloo", 2))]
    assert ids == ["full-state-dict", "tied", "sharded-2to1", "sharded-1to2", "resume", "portability"]
    assert plan.reshard_pairs(8) == [(8, 1), (1, 8), (8, 4)]
    assert plan.reshard_pairs(1) == []


def test_session_only_keys_stay_out_of_the_stored_config() -> None:
    launch = plan.portability_launch(Setup("cpu", "gloo", 2), "/tmp/x", "/refs/checkpoint/cpu-gloo-w2-fp32")
    assert launch.config["bundle"] == "/refs/checkpoint/cpu-gloo-w2-fp32"
    assert not set(plan.SESSION_ONLY) & set(plan.stored(launch.config))
    first, second = plan.resume_launches(Setup("cpu", "gloo", 2), "/tmp/x", "/tmp/x/gpuregress-resume-1")
    assert second.fresh_ranks and not first.fresh_ranks  # the second half runs in new processes


def test_every_fault_mode_is_declared_and_undoes_itself() -> None:
    """Rank processes are reused across launches: each fault point a mode intercepts is released by its cleanup hook."""
    assert set(checkpoint_faults.MODES) == set(faults.KINDS["checkpoint"].params["mode"].choices)
    for mode in checkpoint_faults.MODES:
        ctx = SimpleNamespace(rank=0, cleanup_hooks=[], step_hooks=[])
        faults.install([f"checkpoint:mode={mode},layer=0,proj=down_proj"], ctx)
        assert all(p.startswith("checkpoint.") for p in fault_points.intercepted()) and fault_points.intercepted(), mode
        for undo in reversed(ctx.cleanup_hooks):
            undo()
        assert fault_points.intercepted() == [], mode
