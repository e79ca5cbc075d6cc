"""Recorder: what a user's own training loop hands the plugin, without building a RunRecord by hand.

It records what the built-in scenarios record, in the same form, reduced the way DDP replicas or FSDP2 shards
need, so the same comparison, lanes, reports and plots apply (docs/own-models.md, examples/own_loop/). Methods
marked *collective* run on every rank, in the same order. Only ``step`` is required; what is not recorded is
not compared. Imports torch only inside its methods, on the ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from .evidence import step0 as step0_arrays
from .reference.names import safe_component
from .reference.record import RunRecord, float_digest
from .training.grad_norms import shard_dim_over_world, squared_norms

if TYPE_CHECKING:
    from .scenarios.base import RankContext

Named = Any  # an nn.Module, a mapping name -> tensor, or an iterable of (name, tensor) pairs


class RecorderMisuse(RuntimeError):
    """The recorder was called in a way that would produce a record that cannot be compared."""


class Recorder:
    """One rank's view of a training run; ``record()`` returns the RunRecord for ``gpuregress.check``. ``name``
    is the record's scenario name. Create it right before the loop: step times count from here. Noise replicas
    nudge every weight one ulp when ``model`` is given, and reverse batches in ``batch()``."""

    def __init__(self, ctx: RankContext, name: str, model: Named | None = None) -> None:
        self.ctx = ctx
        self.name = safe_component(name, "Recorder name (it names the reference folder)")
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.param_names: list[str] = []
        self.param_norms: list[np.ndarray] = []
        self.step0: dict[str, np.ndarray] = {}
        self.digests: dict[str, dict[str, Any]] = {}
        self._pending: Any = None  # this step's squared norms (a float64 tensor), reduced in step()
        self._with_gradients: bool | None = None  # fixed by the first step: every step, or never
        self._with_grad_norm: bool | None = None
        self._step_times: list[float] = []
        from .training.observe import PeakMemory

        self._memory = PeakMemory(ctx.device_kind, ctx.device)  # the built-in scenarios' measure, from here on
        self._model = model
        self._tracer: Any = None  # step 0's op trace, made by the first phase() (evidence/op_tracer.py)
        self._perturbation = str(ctx.config.get("perturbation", ""))  # set only in a noise replica
        self._applied = self._perturb(model)
        self._last = time.perf_counter()

    @property
    def steps(self) -> int:
        """Steps recorded so far (calls of ``step``)."""
        return len(self.losses)

    def batch(self, rows: Any) -> Any:
        """This rank's batch (rows first) as the run should use it: reversed in a ``reduction_order`` noise
        replica (the same mean, summed in another order), unchanged otherwise. A tensor, a numpy array, or a
        mapping, tuple or list of them (a transformers batch dict): each is reversed alike."""
        if "reduction_order" not in self._perturbation:
            return rows
        self._applied.add("reduction_order")
        return _reversed_rows(rows)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """``with rec.phase("forward"):`` around a part of each step: ``forward``, ``backward``, ``clip`` or
        ``optimizer``. At step 0 every op dispatched inside is traced with a digest of its outputs; later steps
        run untraced, at no cost. Module paths come from the ``model`` given to the Recorder."""
        from .evidence.op_trace import PHASES
        from .evidence.op_tracer import at_step, for_rank

        if name not in PHASES:
            raise RecorderMisuse(f"phase({name!r}): the phases are {', '.join(PHASES)}")
        if self.steps == 0 and self._tracer is None:
            module = self._model if hasattr(self._model, "named_modules") else None
            self._tracer = for_rank(self.ctx, module)  # None in a noise replica: nothing traced there
        return at_step(self._tracer, self.steps).phase(name)

    def gradients(self, params: Named) -> None:
        """Record every trainable parameter's gradient norm at this step, and at step 0 its gradient. *Collective.*
        Call after ``backward()`` and before clipping or zeroing, on every step or on none. Replicas are averaged
        over ranks and FSDP2 shards summed (a disagreeing replica still moves the value), in ``step``'s all-reduce."""
        if self._pending is not None:
            raise RecorderMisuse(f"gradients() called twice in step {self.steps}: call it once per step, after backward()")
        import torch

        named = [(n, p) for n, p in _named(params) if p.requires_grad]
        self._check_parameters([n for n, _ in named])
        squares = squared_norms([p for _, p in named], self.ctx.world_size, self.ctx.device)  # as the scenarios
        self._pending = torch.stack(squares)
        if self.steps == 0:
            self._record_step0(named)

    def step(self, loss: Any, *, grad_norm: Any = None) -> bool:
        """Close one training step; True when ``--gpuregress-fail-fast`` found it outside the reference's tolerance.
        *Collective* (one all-reduce). ``loss``: this rank's (the record keeps the mean over ranks); ``grad_norm``: the
        global norm (``clip_grad_norm_``'s), on every step or on none; without it, the norm of ``gradients()``."""
        with_gradients = self._pending is not None
        with_norm = grad_norm is not None or with_gradients
        # The one way they can differ here: gradients() itself refuses a first call after step 0.
        self._with_gradients = self._same_as_step0(self._with_gradients, with_gradients,
                                                   "gradients() was called at step 0 but not now: call it on every "
                                                   "step or on none")
        self._with_grad_norm = self._same_as_step0(self._with_grad_norm, with_norm,
                                                   "grad_norm given on some steps and not on others")
        if self.steps == 0 and self._tracer is not None:
            self._tracer.finish()  # step 0 is over: its trace is complete
        mean_loss, norm, squares = self._all_reduced(loss, grad_norm)
        self.losses.append(mean_loss)
        reported = {"loss": mean_loss}
        if with_norm:
            self.grad_norms.append(norm)
            reported["grad_norm"] = norm
        if with_gradients:
            self.param_norms.append(np.sqrt(squares))
        now = time.perf_counter()
        self._step_times.append(now - self._last)
        self._last = now
        return self.ctx.step_done(self.steps - 1, **reported)

    def weights(self, params: Named) -> None:
        """Record digests of every parameter (trainable or not), by name. *Collective* for FSDP2 parameters.

        Call once, after the last step. Sharded parameters are gathered whole, one at a time."""
        for name, p in _named(params):
            self._digest(name, p, "weights()")

    def tensor(self, name: str, value: Any) -> None:
        """Record a digest of any named tensor (logits on a fixed batch, a buffer, an activation). *Collective*
        for a DTensor, which is gathered whole. Each name once: the digests are compared like final weights."""
        self._digest(name, value, "tensor()")

    def record(self) -> RunRecord:
        """The RunRecord of the steps so far, ready for ``gpuregress.check``. Not a collective."""
        from .evidence.op_tracer import stored as stored_trace

        if not self.steps:
            raise RecorderMisuse("record(): no step recorded; call rec.step(loss) once per training step")
        series = {"loss": list(self.losses)}
        if self.grad_norms:
            series["grad_norm"] = list(self.grad_norms)
        arrays: dict[str, np.ndarray] = dict(self.step0)
        if self.param_norms:
            arrays["param_grad_norm"] = np.stack(self.param_norms).astype(np.float64)
        results: dict[str, Any] = {}
        missed = sorted(set(filter(None, self._perturbation.split("+"))) - self._applied)
        if missed:  # a replica this loop did not perturb equals the plain run: say so beside the envelope
            results["perturbation_not_applied"] = missed
        arrays.update(stored_trace(self._tracer, results))
        median = self._perf(results)
        return RunRecord(
            scenario=self.name,
            config=dict(self.ctx.config),
            platform_key="",  # set by the plugin, which knows the platform
            world_size=self.ctx.world_size,
            series=series,
            param_names=list(self.param_names) if self.param_norms else [],
            arrays=arrays,
            digests={k: dict(v) for k, v in self.digests.items()},
            timings={"train_s": float(sum(self._step_times)), "first_step_s": self._step_times[0],
                     "median_step_s": median},
            results=results,
        )

    def _perf(self, results: dict[str, Any]) -> float:
        """The median step time after the warm-up steps, and ``results["perf"]``, as the built-in scenarios: no
        "perf" and a median of 0 when a run stopped before any such step."""
        from .training.observe import WARMUP_STEPS

        steady = self._step_times[WARMUP_STEPS:]
        if not steady:
            return 0.0
        median = float(np.median(steady))
        results["perf"] = {"median_step_s": median, "steady_steps": len(steady),
                           "peak_memory_bytes": self._memory.peak(), "memory": self._memory.kind}
        return median

    def _perturb(self, model: Named | None) -> set[str]:
        """Apply what a noise replica asks of this loop at its start; the perturbations it applied."""
        from .training.noise import apply_kernel_path, perturb_weights

        applied = set()
        if "kernel_path" in self._perturbation:  # the environment on the CPU, the BLAS library on GPUs
            apply_kernel_path(self._perturbation, self.ctx)
            applied.add("kernel_path")
        if model is not None:
            dtype = str(self.ctx.config.get("dtype", "fp32"))
            if perturb_weights((p for _, p in _named(model)), self._perturbation, dtype):
                applied.add("weights_ulp_up" if "weights_ulp_up" in self._perturbation else "weights_ulp_down")
        return applied

    def _check_parameters(self, names: list[str]) -> None:
        """Step 0 fixes the parameters ``gradients()`` records; every later step must give the same ones."""
        if self.steps == 0:
            if not names:
                raise RecorderMisuse("gradients(): no parameter requires a gradient")
            self.param_names = names
        elif not self._with_gradients:
            raise RecorderMisuse(f"gradients() first called at step {self.steps}: call it on every step from step 0, or on none")
        elif names != self.param_names:
            raise RecorderMisuse(f"gradients() at step {self.steps}: other parameters than at step 0 "
                                 f"({len(names)} vs {len(self.param_names)}); pass the same model every step")

    def _same_as_step0(self, fixed: bool | None, now: bool, misuse: str) -> bool:
        """Step 0 fixes what every step does (``gradients()`` called, a norm given): a later step that differs is misuse."""
        if fixed is not None and now != fixed:
            raise RecorderMisuse(f"step {self.steps}: {misuse}")
        return now

    def _all_reduced(self, loss: Any, grad_norm: Any) -> tuple[float, float, np.ndarray]:
        """The mean loss over ranks, the mean ``grad_norm`` (else the norm of this step's gradients) and each
        parameter's squared gradient norm: one float64 all-reduce per step carries them all."""
        import torch

        device = self.ctx.device
        loss = _scalar(loss, "loss", device)
        norm = _scalar(grad_norm, "grad_norm", device) if grad_norm is not None else loss.new_zeros(())
        squares = self._pending if self._pending is not None else loss.new_zeros(0)
        self._pending = None
        stats = torch.cat([torch.stack([loss, norm]), squares])
        if self.ctx.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(stats)
            stats[:2] /= self.ctx.world_size
        values = stats.cpu().numpy().astype(np.float64)
        norm = float(values[1]) if grad_norm is not None else math.sqrt(float(values[2:].sum()))
        return float(values[0]), norm, values[2:]

    def _record_step0(self, named: list[tuple[str, Any]]) -> None:
        """Rank 0 keeps every step-0 gradient whole (or as block sums when large); shards are gathered to it."""
        full_max = step0_arrays.full_max_of(self.ctx.config)
        shards: dict[str, np.ndarray] = {}  # one entry per dim-0 shard: empty on every rank, or on none
        for name, grad in ((n, p.grad) for n, p in named if p.grad is not None):
            if hasattr(grad, "to_local") and shard_dim_over_world(grad, self.ctx.world_size) == 0:
                shards.update(step0_arrays.shard_arrays(name, _numpy(grad.to_local()), tuple(grad.shape),
                                                        self.ctx.rank, self.ctx.world_size, full_max))
                continue
            whole = _whole(grad)  # a replica, or gathered whole
            if self.ctx.rank == 0:
                self.step0.update(step0_arrays.shard_arrays(name, _numpy(whole), tuple(whole.shape), 0, 1, full_max))
        if shards:
            self._gather_shards(shards)

    def _gather_shards(self, mine: dict[str, np.ndarray]) -> None:
        """Rank 0 merges every rank's step-0 shards. *Collective.*"""
        parts: list[Any] = [mine]
        if self.ctx.world_size > 1:
            import torch.distributed as dist

            # Our own ranks' numpy arrays: pickling them is safe here, and the shards are small
            # (large gradients travel as block sums, 5 float64 per 1024 elements).
            parts = [None] * self.ctx.world_size
            dist.gather_object(mine, parts if self.ctx.rank == 0 else None, dst=0)
        if self.ctx.rank == 0:
            self.step0.update(step0_arrays.merge_ranks([SimpleNamespace(arrays=p) for p in parts]))

    def _digest(self, name: str, value: Any, what: str) -> None:
        if name in self.digests:
            raise RecorderMisuse(f"{what}: {name!r} is already recorded; give each tensor a name of its own")
        self.digests[name] = float_digest(_numpy(_whole(value)))


def _reversed_rows(rows: Any) -> Any:
    if isinstance(rows, Mapping):  # a plain dict back, for model(**batch)
        return {k: _reversed_rows(v) for k, v in rows.items()}
    if isinstance(rows, (tuple, list)):
        return type(rows)(_reversed_rows(v) for v in rows)
    if isinstance(rows, np.ndarray):
        return rows[::-1].copy()
    if hasattr(rows, "flip"):
        return rows.flip(0)
    raise RecorderMisuse(f"batch(): cannot reverse the rows of a {type(rows).__name__}; pass a tensor, a numpy array, "
                         "or a dict, tuple or list of them")


def _named(params: Named) -> list[tuple[str, Any]]:
    if hasattr(params, "named_parameters"):
        return list(params.named_parameters())
    if isinstance(params, Mapping):
        return list(params.items())
    if isinstance(params, Iterable):
        pairs = list(params)
        if all(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) for pair in pairs):
            return pairs
    raise TypeError("expected a model, a mapping name -> tensor, or (name, tensor) pairs such as model.named_parameters()")


def _scalar(value: Any, what: str, device: str) -> Any:
    """A float64 0-dim tensor on ``device`` from a float or a one-element tensor (a DTensor is gathered)."""
    import torch

    if isinstance(value, torch.Tensor):
        value = _whole(value)
        if value.numel() != 1:
            raise RecorderMisuse(f"{what} must be a float or a one-element tensor, got shape {tuple(value.shape)}")
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    try:
        return torch.tensor(float(value), dtype=torch.float64, device=device)
    except (TypeError, ValueError):
        raise RecorderMisuse(f"{what} must be a float or a one-element tensor, got {type(value).__name__}") from None


def _whole(tensor: Any) -> Any:
    """A DTensor gathered whole (a collective), any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _numpy(tensor: Any) -> np.ndarray:
    """A host copy; bf16, fp16 and fp8 widened to float32 (numpy has no such types), fp32 and fp64 kept."""
    value = tensor.detach()
    if value.is_floating_point() and value.element_size() < 4:
        value = value.float()
    return value.cpu().numpy().copy()  # a copy: on the CPU the array would share memory with a live tensor
