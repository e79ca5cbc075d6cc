"""The training step every built-in scenario runs, and the loop around it.

One all-reduce per step carries the loss, every tracked parameter's squared norm and the clipped norm:
the norm after clipping is what a wrong or skipped clip moves. Each step's figures go to ``ctx.step_done``
(progress, step faults, fail-fast); ``training_record`` assembles what it measured into the run's record,
one assembly for the fsdp and lora ranks. Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..evidence.data_change import BATCH_DIGEST
from ..evidence.op_tracer import OpTracer, at_step, stored
from ..reference.record import RunRecord
from .collective_ledger import watching
from .grad_norms import squared_norms
from .observe import StepObserver
from .optimizer import Optimization


def plain_backward(loss: Any) -> None:
    loss.backward()


def clip_gradients(params: list[Any], max_norm: float) -> float:
    """``clip_grad_norm_`` over ``params``; the global norm before clipping (an FSDP2 DTensor norm gathered)."""
    import torch

    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    return float(total.double())


@dataclass
class TrainStep:
    """What one training step is made of on a rank."""

    loss: Callable[[int], Any]  # the step's loss on this rank (the forward pass), given the step's number
    optimization: Optimization
    clip: Callable[[], float]  # clips the gradients, returns the global norm before clipping
    backward: Callable[[Any], None] = plain_backward  # accelerate's own in its lane
    tracked: list[Any] = field(default_factory=list)  # parameters whose gradient norm is recorded every step
    # After backward, before clipping, given the step's number: a scenario's own look at the gradients
    # (its step-0 gradients, gradients on frozen weights). May run collectives: every rank calls it.
    inspect: Callable[[int], None] | None = None
    # Traces step 0's ops, phase by phase (op_trace.py): the session names the first op that moved. None: no trace.
    op_trace: OpTracer | None = None


@dataclass
class StepResult:
    loss: float  # the mean over ranks
    grad_norm: float  # the global norm, before clipping
    param_norms: np.ndarray  # each tracked parameter's global gradient norm, float64
    clipped_norm: float  # the tracked parameters' global gradient norm after clipping
    batch_digest: float | None = None  # the sum of the ranks' token-batch digests (training/step.py); None: unknown


def take_step(parts: TrainStep, step: int, ctx: Any) -> StepResult:
    """One optimizer step on the rank ``ctx`` describes. Collective: clipping and the all-reduce of the figures."""
    import torch
    import torch.distributed as dist

    world_size, device = ctx.world_size, ctx.device
    trace = at_step(parts.op_trace, step)  # step 0's tracer; later steps: one that traces nothing
    ctx.batch_digest = None
    with trace.phase("forward"):
        loss = parts.loss(step)
    read = ctx.batch_digest  # the batch the forward read, where it came through rank_tokens
    with trace.phase("backward"):
        parts.backward(loss)
    squares = squared_norms(parts.tracked, world_size, device)
    if parts.inspect is not None:
        parts.inspect(step)
    with trace.phase("clip"):
        grad_norm = parts.clip()
    clipped = torch.stack(squared_norms(parts.tracked, world_size, device)).sum() if squares else loss.new_zeros(())
    # One float64 all-reduce per step carries the loss, every tracked parameter's squared norm, the clipped one and
    # the ranks' batch digests (summed: exact, each fits 44 bits).
    digest = loss.new_tensor(read if read is not None else float("nan"), dtype=torch.float64)
    stats = torch.stack([loss.detach().double(), *squares, clipped.double(), digest])
    with trace.phase("optimizer"):
        parts.optimization.step()
    trace.finish()
    dist.all_reduce(stats)
    stats = stats.cpu()
    total = float(stats[-1])
    return StepResult(loss=float(stats[0]) / world_size, grad_norm=grad_norm, param_norms=stats[1:-2].sqrt().numpy(),
                      clipped_norm=float(stats[-2].sqrt()), batch_digest=total if total == total else None)


@dataclass
class Curves:
    """Per step: the loss, the gradient norm before and after clipping, each tracked parameter's norm."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    param_norm_rows: list[np.ndarray] = field(default_factory=list)
    clipped_norms: list[float] = field(default_factory=list)
    # What the collectives of these steps said of themselves (collective_ledger.py), for the record's results.
    collectives: dict[str, Any] = field(default_factory=dict)
    batch_digests: list[float | None] = field(default_factory=list)

    def add(self, result: StepResult) -> None:
        self.losses.append(result.loss)
        self.grad_norms.append(result.grad_norm)
        self.param_norm_rows.append(result.param_norms)
        self.clipped_norms.append(result.clipped_norm)
        self.batch_digests.append(result.batch_digest)

    def series(self) -> dict[str, list[float]]:
        """The record's per-step series; the token batches' digests only where every step's is known."""
        out = {"loss": self.losses, "grad_norm": self.grad_norms, "clipped_grad_norm": self.clipped_norms}
        if self.batch_digests and all(d is not None for d in self.batch_digests):
            out[BATCH_DIGEST] = [float(d) for d in self.batch_digests]  # type: ignore[arg-type]
        return out

    def param_norms(self, tracked: int) -> np.ndarray:
        """Steps x tracked parameters, float64 (the record's ``param_grad_norm``)."""
        return np.array(self.param_norm_rows, dtype=np.float64).reshape(len(self.param_norm_rows), tracked)


def train(ctx: Any, parts: TrainStep, steps: Iterable[int], *, observer: StepObserver | None = None,
          progress: str | None = None, report_metrics: bool = True, stop_when_told: bool = True) -> Curves:
    """Run ``steps``; return their curves. ``report_metrics`` False: ``ctx.step_done`` gets the step number only;
    ``stop_when_told``: stop after the step at which fail-fast stopped the run."""
    if progress is not None:
        ctx.progress(progress)
    curves = Curves()
    # Every collective of every step, checked by its own invariants across the ranks (collective_ledger.py).
    ledger = watching(ctx) if ctx.world_size > 1 else nullcontext()
    try:
        with ledger as watched:
            for step in steps:
                ctx.current_step = step  # what a fault that starts late reads (RankContext.current_step)
                with observer.step(step) if observer is not None else nullcontext():
                    result = take_step(parts, step, ctx)
                curves.add(result)
                metrics = {"loss": result.loss, "grad_norm": result.grad_norm} if report_metrics else {}
                if ctx.step_done(step, **metrics) and stop_when_told:
                    break
    finally:
        ctx.current_step = None  # after training (digests, saves) no step runs: a late fault does not act there
    if watched is not None:
        curves.collectives = watched.results()
    return curves


def train_observed(ctx: Any, parts: TrainStep, config: dict[str, Any]) -> tuple[Curves, StepObserver]:
    """Every step of a training config, timed and profiled; the curves and the finished observer, for
    ``training_record``."""
    steps = int(config["steps"])
    observer = StepObserver(ctx, steps, tokens_per_step=int(config["global_batch"]) * int(config["seq_len"]))
    curves = train(ctx, parts, range(steps), observer=observer, progress="training")
    observer.finish(ctx.world_size)
    return curves, observer


def training_record(scenario: str, ctx: Any, step: TrainStep, curves: Curves, observer: StepObserver,
                    names: list[str], step0: dict[str, np.ndarray], digests: dict[str, Any],
                    results: dict[str, Any]) -> RunRecord:
    """``results`` gets the observer's results and step 0's op trace (op_trace.py) besides the scenario's own."""
    results.update(observer.results())
    results.update(curves.collectives)
    traced = stored(step.op_trace, results)
    return RunRecord(
        scenario=scenario,
        config=dict(ctx.config),
        platform_key="",  # set by the plugin, which knows the platform
        world_size=ctx.world_size,
        series=curves.series(),
        param_names=names,
        arrays={"param_grad_norm": curves.param_norms(len(step.tracked)), **step0, **traced},
        digests=digests,
        results=results,
        timings=observer.timings(),
    )
