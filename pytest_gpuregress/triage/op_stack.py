"""The Python stack of the first op that moved (evidence/first_moved.py): step 0 re-run on this stack, keeping
the stack of that one op on its rank (evidence/op_tracer.py, config ``STACK_CONFIG``). With --gpuregress-triage,
whose launches it joins: one more short launch of the failing scenario."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..evidence.first_moved import FirstMoved
from ..evidence.op_trace import STACK_CONFIG, STACK_KEY
from . import Runner, model_suffix

if TYPE_CHECKING:
    from ..scenarios.base import Scenario, Setup


def keep_stack(sc: Scenario, setup: Setup, run: Runner, moved: FirstMoved, model: str | None = None) -> list[str]:
    """The lines to report: the op's Python stack, and for a backward op where its autograd node was made."""
    from ..scenarios.base import Launch

    config = {**sc.model_config(setup, model), "steps": 1, STACK_CONFIG: [moved.rank, moved.entry_index]}
    launch = Launch(f"op-stack-{moved.rank}-{moved.entry_index}{model_suffix(model)}", config)
    kept = run(sc, launch).results.get(STACK_KEY)
    if not kept:
        return ["its Python stack: the re-run of step 0 kept none"]
    expected = moved.entry.op if moved.entry is not None else None
    if kept.get("op") != expected:  # the re-run's ops came in another order: its stack would be another op's
        return [f"its Python stack: the re-run of step 0 ran {kept.get('op')} there, not {expected}: not kept"]
    lines = ["its Python stack (step 0 re-run on this stack):", *_frames(kept["stack"])]
    if kept.get("forward_stack"):
        lines += ["where its autograd node was made, in the forward:", *_frames(kept["forward_stack"])]
    return lines


def _frames(stack: list[str]) -> list[str]:
    return [line.rstrip() for frame in stack for line in frame.splitlines() if line.strip()]
