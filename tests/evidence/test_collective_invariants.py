"""Every collective of a training run held to its own invariants across its ranks, at every step (#46 item 2):
a bug that needs a warmed-up process never recurs in a replay, so the run itself must show it.

Unit tests on evidence/collective_invariants.py's check, then two gloo ranks running FSDP2's own collectives
through the ledger (training/collective_ledger.py) with a fault that starts late and acts on one rank only, as a
reused buffer pool would: the step, the collective and the rank are named; a clean run names nothing."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pytest_gpuregress.evidence import collective_invariants as inv
from pytest_gpuregress.triage.naming import component_of, described, rule_for

OPS = ["all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter"]
REDUCTIONS = ["none", "sum", "avg", "max", "min", "product", "premul_sum", "other"]


def row(step: int, seq: int, op: str, *, reduce: str = "none", inputs: tuple[float, float, float],
        outputs: tuple[float, float, float], bits: int, factor: float = 1.0,
        weighted: tuple[float, float] = (math.nan, math.nan)) -> np.ndarray:
    values = [step, 0, seq, OPS.index(op), REDUCTIONS.index(reduce), factor, 2.0**-24, 100, *inputs, *outputs,
              float(np.int64(bits).view(np.float64)), *weighted]
    return np.array(values, dtype=np.float64)


def judge(rank_rows: dict[int, list[np.ndarray]]) -> list[inv.Violation]:
    return inv.check({r: np.stack(rows) for r, rows in rank_rows.items()}, OPS, ["0,1"], REDUCTIONS)[1]


def test_an_all_gather_whose_ranks_hold_other_bits_names_the_rank_whose_sum_is_off() -> None:
    good = row(100, 7, "all_gather", inputs=(1.0, 1.0, 1.0), outputs=(3.0, 3.0, 5.0), bits=11)
    stale = row(100, 7, "all_gather", inputs=(2.0, 2.0, 4.0), outputs=(2.5, 3.0, 5.0), bits=12)
    found = judge({0: [stale], 1: [good]})
    assert len(found) == 1 and found[0].ranks == (0,) and found[0].step == 100
    assert (found[0].op, found[0].seq, found[0].group) == ("all_gather", 7, "0,1")
    assert found[0].what.startswith("the ranks' outputs have different bits")
    said = found[0].describe()
    assert said.startswith("step 100: all_gather call 7 ") and "of process group [0,1]: " in said


def test_a_reduce_scatter_output_off_by_one_element_breaks_the_sum_and_rounding_does_not() -> None:
    squares = 20_000.0  # 20k elements of about 1: the bound is 8 u sqrt(2 x 2 x squares) = 6.7e-5
    allowed = inv.LAMBDA * 2.0**-24 * math.sqrt(2 * 2 * 2 * squares)
    clean = [row(5, 1, "reduce_scatter", reduce="sum", inputs=(100.0, 20_000.0, squares),
                 outputs=(100.0 + s * allowed / 4, 20_000.0, squares), bits=r) for r, s in ((0, 1), (1, -1))]
    assert judge({0: [clean[0]], 1: [clean[1]]}) == []
    wrong = row(5, 1, "reduce_scatter", reduce="sum", inputs=(100.0, 20_000.0, squares), outputs=(100.0 + 1e-3, 1, 1),
                bits=0)
    found = judge({0: [wrong], 1: [clean[1]]})
    assert len(found) == 1 and "SUM of its inputs" in found[0].what and "x the rounding bound" in found[0].what
    avg = [row(5, 1, "reduce_scatter", reduce="avg", inputs=(100.0, 1.0, 1.0), outputs=(50.0, 1.0, 1.0), bits=r)
           for r in (0, 1)]
    assert judge({0: [avg[0]], 1: [avg[1]]}) == []  # AVG: the outputs sum to the inputs' over the group size


def test_a_clean_record_passes_and_the_summary_keeps_a_few_numbers() -> None:
    rows = {r: [row(s, s + 1, "broadcast", inputs=(1, 1, 1), outputs=(1, 1, 1), bits=5) for s in range(4)] for r in (0, 1)}
    calls, found = inv.check({r: np.stack(v) for r, v in rows.items()}, OPS, ["0,1"], REDUCTIONS)
    assert (calls, found) == (4, []) and inv.summary(calls, found) == {"calls": 4, "violated": 0, "violations": [], "ops": []}
    assert inv.problems({inv.RESULT_KEY: inv.summary(calls, found)}) == []


def _rank(rank: int, world: int, store: str, out: str, faults: list[str]) -> None:
    """FSDP2 on a tiny model for 6 steps through the ledger, each step's all-gathers and reduce-scatters."""
    import json

    import torch
    import torch.distributed as dist

    from pytest_gpuregress.faults import install_counted
    from pytest_gpuregress.training.collective_ledger import watching
    from pytest_gpuregress.training.fsdp2 import shard

    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    shard([("0", model[0]), ("1", model[1]), ("", model)])
    ctx = SimpleNamespace(rank=rank, world_size=world, cleanup_hooks=[], config={}, current_step=None)
    install_counted(faults, ctx)
    with watching(ctx) as ledger:
        for step in range(6):
            ctx.current_step = step
            model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step * 10 + rank))).sum().backward()
    ctx.current_step = None
    found = ledger.results()
    for cleanup in ctx.cleanup_hooks:
        cleanup()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    os._exit(0)  # past gloo's teardown, which on torch 2.13 may abort a process whose work is done (SIGABRT)


def test_the_position_weighted_sum_sees_two_swapped_elements_and_follows_the_global_offset() -> None:
    import torch

    from pytest_gpuregress.training.collective_ledger import WEIGHT_PERIOD, weighted_sum

    x = torch.randn(3 * WEIGHT_PERIOD + 17, generator=torch.Generator().manual_seed(0))
    swapped = x.clone()
    swapped[[10, 20]] = x[[20, 10]]
    assert abs(weighted_sum([swapped]) - weighted_sum([x])) > 1e-3 * float(x.abs().max())
    assert float(swapped.double().sum()) == pytest.approx(float(x.double().sum()), abs=1e-12)
    head, tail = x[:1000], x[1000:]
    assert weighted_sum([head, tail]) == pytest.approx(weighted_sum([x]), rel=1e-13)
    assert weighted_sum([tail], 1000) == pytest.approx(weighted_sum([x]) - weighted_sum([head]), rel=1e-12)


def test_a_permutation_alike_on_every_rank_breaks_the_weighted_sums_where_sums_and_hashes_hold() -> None:
    """#46, the helper's fault 11b: an all-gather whose output has two elements swapped on every rank (one buffer
    pool, one bug): the same bits everywhere, the same sums; only the position-weighted sums see it."""
    gather = {r: row(150, 9, "all_gather", inputs=(1.0, 1.0, 1.0), outputs=(2.0, 2.0, 2.0), bits=7,
                     weighted=(0.5 + r, 2.0)) for r in (0, 1)}
    assert judge({r: [v] for r, v in gather.items()}) == []
    swapped = {r: row(150, 9, "all_gather", inputs=(1.0, 1.0, 1.0), outputs=(2.0, 2.0, 2.0), bits=7,
                      weighted=(0.5 + r, 2.25)) for r in (0, 1)}
    found = judge({r: [v] for r, v in swapped.items()})
    assert len(found) == 1 and found[0].ranks == (0, 1) and "not each in its place" in found[0].what
    scatter = {r: row(150, 10, "reduce_scatter", reduce="sum", inputs=(1.0, 1000.0, 1000.0),
                      outputs=(1.0, 1000.0, 1000.0), bits=r, weighted=(3.0, 3.0 + 0.4 * (r == 1))) for r in (0, 1)}
    found = judge({r: [v] for r, v in scatter.items()})
    assert len(found) == 1 and "position-weighted sum" in found[0].what


@pytest.mark.parametrize("faults", [[], ["collective:op=all_gather,mode=stale_chunk,from_step=3,ranks=0"],
                                    ["collective:op=reduce_scatter,mode=swap,from_step=4"]])
def test_fsdp2s_collectives_through_the_ledger_name_a_late_one_rank_fault_at_its_step(tmp_path: Path,
                                                                                    faults: list[str]) -> None:
    import json

    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(tmp_path), faults), nprocs=2)
    verdicts = [json.loads((tmp_path / f"rank{r}.json").read_text())[inv.RESULT_KEY] for r in (0, 1)]
    assert verdicts[0] == verdicts[1] and verdicts[0]["calls"] >= 6 * 4  # both ranks judged every call alike
    if not faults:
        assert verdicts[0]["violated"] == 0, verdicts[0]
        return
    first = verdicts[0]["violations"][0]
    if "mode=swap" in faults[0]:  # the same swap on both ranks' outputs: only their places are wrong
        assert (first["step"], first["op"]) == (4, "reduce_scatter") and "not each in its place" in first["what"]
        return
    assert (first["step"], first["op"], first["ranks"]) == (3, "all_gather", [0]), verdicts[0]
    found = inv.problems({inv.RESULT_KEY: verdicts[0]})[0]
    assert (rule_for(found).id, component_of(found)) == ("collective-invariants", "collective")
    problem = described(found)
    assert problem.startswith("[collective] ") and "broke its own invariant" in problem and "step 3:" in problem
