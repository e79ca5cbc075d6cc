"""triage/explain.py (keep_stack): the Python stack of the first op that moved comes from a one-step re-run that keeps that
op's stack, and is reported only where the re-run reached the same op there."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from pytest_gpuregress.evidence.first_moved import FirstMoved
from pytest_gpuregress.evidence.op_trace import STACK_CONFIG, STACK_KEY, TraceOp
from pytest_gpuregress.triage.explain import keep_stack


def _moved(op: str = "aten::mm") -> FirstMoved:
    entry = TraceOp(index=7, op=op, module="model.layers.0.mlp", region="", phase="backward", inputs="",
                    outputs=("[4, 4]",), digests=np.zeros((1, 3)), hashes=np.zeros(1, dtype=np.int64))
    return FirstMoved(rank=1, kind="moved", entry=entry, reference=entry, equal_before=7, relative=0.5, world=2)


class Scenario:
    name = "fsdp"

    def model_config(self, setup: Any, model: str | None) -> dict[str, Any]:
        return {"steps": 300, "lr": 1e-3}


def _runner(kept: dict[str, Any] | None, launches: list[Any]) -> Any:
    def run(sc: Any, launch: Any) -> Any:
        launches.append(launch)
        return SimpleNamespace(results={STACK_KEY: kept} if kept is not None else {})
    return run


def test_the_re_run_keeps_one_step_and_the_stack_of_that_op_on_its_rank() -> None:
    launches: list[Any] = []
    kept = {"op": "aten::mm", "stack": ["  File \"model.py\", line 3, in forward\n    y = x @ w\n"],
            "forward_stack": ["  File \"model.py\", line 2, in forward\n"]}
    lines = keep_stack(Scenario(), SimpleNamespace(), _runner(kept, launches), _moved())
    (launch,) = launches
    assert launch.config["steps"] == 1 and launch.config[STACK_CONFIG] == [1, 7]
    assert lines[0].startswith("its Python stack") and '  File "model.py", line 3, in forward' in lines
    assert any(line.startswith("where its autograd node was made") for line in lines)


def test_a_re_run_that_reached_another_op_there_reports_no_stack() -> None:
    lines = keep_stack(Scenario(), SimpleNamespace(), _runner({"op": "aten::add", "stack": ["x"]}, []), _moved())
    (line,) = lines
    assert line.startswith("its Python stack: ") and "ran aten::add there, not aten::mm" in line
    lines = keep_stack(Scenario(), SimpleNamespace(), _runner(None, []), _moved())
    (line,) = lines
    assert line.startswith("its Python stack: ") and line.endswith(" kept none")
