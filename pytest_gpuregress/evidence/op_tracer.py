"""The step-0 op trace: every op dispatched in a traced phase, with where it ran and a digest of each output.

The session finds the first op whose output moved (evidence/first_moved.py). An input no traced op made
enters once as an ``<input>`` entry, and each entry keeps its sources, so an op that moved with equal inputs
convicts its kernel (docs/triage.md). Tracing only reads: outputs are digested just before the next traced op,
so a fault that changes them counts as the op's own output. Torch is imported inside the functions.
"""

from __future__ import annotations

import time
import traceback
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from ..fault_points import FAULT_REGION
from .op_arguments import arguments_text, calling_package
from .op_trace import COLLECTIVES, INPUT_OP, PHASES, STACK_CONFIG, STACK_KEY, TRACE_CONFIG, RankTrace
from .op_trace_modes import op_watch
from .op_trace_modules import ModulePaths, ParameterLineage, fsdp_unit, tensors_in
from .tensor_digest import HASH_KIND, digest_and_sketch

_REGION_ENTER = "profiler::_record_function_enter_new"
_REGION_EXIT = "profiler::_record_function_exit"
# Outputs of uninitialised memory: digesting them would read garbage.
_ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
                "aten::empty_permuted", "aten::resize_"}
# Ops that make no new values (a wait, a wrapper, a detach that is no view by schema).
_NO_NEW_VALUES = {"_c10d_functional::wait_tensor", "c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd",
                  "aten::lift_fresh", "aten::detach", "aten::alias", "aten::_unsafe_view", "aten::_local_scalar_dense"}
# Ops that return more than they fill: the outputs to digest. FSDP2's copy-in returns its all-gather buffer,
# filled only in this rank's slot until the all-gather runs; attention kernels return RNG state and buffers.
_FILLED_OUTPUTS = {"fsdp::all_gather_copy_in": (0,), "aten::_scaled_dot_product_flash_attention": (0, 1),
                   "aten::_scaled_dot_product_efficient_attention": (0, 1),
                   "aten::_scaled_dot_product_cudnn_attention": (0, 1), "aten::_flash_attention_forward": (0, 1),
                   "aten::_efficient_attention_forward": (0, 1)}
_MAX_INPUTS_SHOWN = 4
_STACK_FRAMES = 30
# Frames a kept stack leaves out: the tracer's own, the launcher's below the scenario, and decorators' wrappers.
_NOT_SHOWN = ("pytest_gpuregress/evidence/op_trace", "pytest_gpuregress/evidence/tensor_digest",
              "torch/utils/_python_dispatch", "torch/utils/_debug_mode", "pytest_gpuregress/launch/", "<frozen runpy>",
              "torch/_dynamo/eval_frame.py", "torch/_compile.py")


def op_name(func: Any) -> str:
    """"aten::mm" for ``torch.ops.aten.mm.default``: the schema's name, without the overload."""
    schema = getattr(func, "_schema", None)
    return str(schema.name) if schema is not None else str(func)


def shape_text(tensor: Any) -> str:
    from torch.utils._dtype_abbrs import dtype_abbrs

    return f"{dtype_abbrs.get(tensor.dtype, str(tensor.dtype))}{list(tensor.shape)}"


def inputs_text(tensors: list[Any]) -> str:
    shown = [shape_text(t) for t in tensors[:_MAX_INPUTS_SHOWN]]
    more = len(tensors) - len(shown)
    return " x ".join(shown) + (f" x {more} more" if more > 0 else "")


class _Storages:
    """Storages the trace has met, by identity, forgotten when freed (their ids are then reused): those ops
    made, the views of the others already kept as inputs, and the entry that last wrote each (an op's sources)."""

    _MADE = "made"
    _WRITER = "writer"

    def __init__(self) -> None:
        self._seen: dict[int, dict[Any, int]] = {}  # storage id -> {_MADE, _WRITER or a view's key: entry index}
        self._finalizers: list[weakref.finalize] = []

    def _views(self, tensor: Any) -> dict[Any, int] | None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): nothing to keep
            return None
        key = id(storage)
        if key not in self._seen:
            self._seen[key] = {}
            self._finalizers.append(weakref.finalize(storage, self._seen.pop, key, None))
        return self._seen[key]

    @staticmethod
    def _view_key(tensor: Any) -> tuple[Any, ...]:
        return tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype)

    def close(self) -> None:
        """Forget every storage: ranks outlive a launch, and a long-lived storage would keep its finalizer."""
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers, self._seen = [], {}

    def made(self, tensor: Any) -> None:
        views = self._views(tensor)
        if views is not None:
            views[self._MADE] = -1

    def was_made(self, tensor: Any) -> bool:
        views = self._views(tensor)
        return views is None or self._MADE in views

    def first_read(self, tensor: Any) -> bool:
        """True the first time a view of a storage no traced op made is read."""
        views = self._views(tensor)
        if views is None or self._MADE in views:
            return False
        key = self._view_key(tensor)
        if key in views:
            return False
        views[key] = -1
        return True

    def wrote(self, tensor: Any, index: int, *, as_input: bool = False) -> None:
        """Entry ``index`` made ``tensor``'s values (an ``<input>`` entry: that view's)."""
        views = self._views(tensor)
        if views is not None:
            views[self._view_key(tensor) if as_input else self._WRITER] = index

    def writer(self, tensor: Any) -> int | None:
        """The entry whose values ``tensor`` holds: the later of its view's ``<input>`` entry and the storage's
        last writer (an op that wrote into an input's storage in place after it was read, as AdamW's step does)."""
        views = self._views(tensor)
        if views is None:
            return None
        found = max(views.get(self._view_key(tensor), -1), views.get(self._WRITER, -1))
        return found if found >= 0 else None


Digested = tuple[tuple[float, float, float, int], Any]  # the digest, and the sketch (None where none is kept)


def _digest_of(tensor: Any) -> Digested:
    """``digest_and_sketch``, or NaNs and no sketch for an output whose storage was freed before it could be read
    (FSDP2 frees storages by resizing them to 0, which no dispatched op shows): the same in every run, so never a
    difference."""
    try:
        return digest_and_sketch(tensor)
    except RuntimeError:
        return (float("nan"), float("nan"), float("nan"), 0), None


def _written(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The tensors an op that returns none writes into (``out=`` lists): its mutable arguments."""
    out: list[Any] = []
    schema = getattr(func, "_schema", None)  # a higher-order operator has none
    for i, argument in enumerate(schema.arguments if schema is not None else ()):
        alias = argument.alias_info
        if alias is not None and alias.is_write:
            out += tensors_in(args[i] if i < len(args) else kwargs.get(argument.name))
    return out


class OpTracer:
    """Traces the ops of step 0 on one rank (see the module docstring)."""

    def __init__(self, rank: int, model: Any | None = None, *, named_parameters: Iterable[tuple[str, Any]] | None = None,
                 stack_at: int | None = None, backend: str = "auto") -> None:
        self.rank = rank
        self.stack_at = stack_at
        self._params = list(named_parameters if named_parameters is not None else
                            (model.named_parameters() if model is not None else []))
        self._paths = ModulePaths(model)
        self._lineage = ParameterLineage()
        self._storages = _Storages()
        self._watch = op_watch(self, backend)
        self.backend = str(self._watch.name)
        self._phase: str | None = None
        self._regions: list[str] = []
        self._entries: list[tuple[str, str, str, str, str, list[str]]] = []  # op, module, region, phase, inputs, outputs
        self._sources: list[list[int]] = []  # per entry: the entries whose values its inputs hold
        self._arguments: list[str] = []  # per entry: its non-tensor arguments (op_arguments.py)
        self._packages: list[str] = []  # per entry: the package whose code ran it
        self._digests: list[list[Digested]] = []
        self._pending: tuple[int, list[Any]] | None = None  # the last op: digested before the next one runs
        self._in_flight: dict[int, tuple[int, list[Any]]] = {}  # collectives, by output storage: until read
        self.stack: dict[str, Any] | None = None
        self.seconds = 0.0
        self.finished = False
        self.error: str | None = None  # what stopped the trace: a trace the tracer could not take is no evidence

    # --- phases ------------------------------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Trace the ops run inside as phase ``name`` (one of PHASES)."""
        if self.finished:
            yield
            return
        assert name in PHASES, name
        import torch

        self._phase, self._regions = name, []
        if name in ("clip", "optimizer"):
            self._lineage.seed(self._params)
        self._paths.install()
        # The re-run that keeps a stack records where each autograd node was made (anomaly mode's tracebacks).
        anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False) \
            if self.stack_at is not None and name == "forward" else nullcontext()
        started = time.perf_counter()
        try:
            with anomaly, self._watch:
                yield
            self._guarded(self._settle)  # outside the mode: the digests' ops are not traced (collectives: when read)
        except BaseException:
            self._close()  # a step that raised: no hook of the trace may outlive it in a pooled rank
            raise
        finally:
            self.seconds += time.perf_counter() - started
            self._phase = None

    def finish(self) -> None:
        """Step 0 is over: remove the module hooks; later steps run untraced."""
        self._guarded(self._settle)
        self._guarded(self._land, None)
        self._close()

    def _close(self) -> None:
        self._paths.remove()
        self._storages.close()
        self._lineage.close()
        self._pending, self._in_flight = None, {}
        self.finished = True

    # --- the two dispatch hooks (op_trace_modes.py) --------------------------------------------------------

    def before(self, func: Any, args: Any, kwargs: Any) -> None:
        self._guarded(self._before, func, args, kwargs)

    def after(self, func: Any, args: Any, kwargs: Any, result: Any) -> None:
        self._guarded(self._after, func, args, kwargs, result)

    def _guarded(self, hook: Any, *args: Any) -> None:
        """Run a dispatch hook; a failure of the tracer stops the trace, never the training."""
        if self.error is not None:
            return
        try:
            hook(*args)
        except Exception as exc:  # noqa: BLE001 - the step goes on untraced; the record says why
            self.error = f"{type(exc).__name__}: {exc}"
            self._pending, self._in_flight = None, {}

    def _before(self, func: Any, args: Any, kwargs: Any) -> None:
        name = op_name(func)
        if name in (_REGION_ENTER, _REGION_EXIT) or self._in_fault() or self._skips(func, name) \
                or self._backend_copy(name, args):
            return
        self._settle()
        inputs = list(tensors_in((args, kwargs)))
        self._land(inputs)
        for tensor in inputs:
            if self._storages.first_read(tensor):
                self._add(INPUT_OP, self._where(inputs), inputs_text([tensor]), [tensor], [], as_input=True)
                self._settle()

    def _after(self, func: Any, args: Any, kwargs: Any, result: Any) -> None:
        name = op_name(func)
        if self._region_mark(name, args):
            return
        outputs = list(tensors_in(result)) or _written(func, args, kwargs)
        if not self._aliases(func, name):  # a view's storage is its base's: made here only if the base was
            for tensor in outputs:
                self._storages.made(tensor)
        if self._in_fault():
            self._take_fault_output(outputs)
            return
        if self._skips(func, name) or not outputs or self._backend_copy(name, args):
            return
        self._record(func, name, args, kwargs, outputs)

    def _region_mark(self, name: str, args: Any) -> bool:
        """Enter or leave a profiler region (``record_function``); True where op ``name`` is one of those marks."""
        if name == _REGION_ENTER:
            self._regions.append(str(args[0]))
        elif name == _REGION_EXIT and self._regions:
            self._regions.pop()
        return name in (_REGION_ENTER, _REGION_EXIT)

    def _record(self, func: Any, name: str, args: Any, kwargs: Any, outputs: list[Any]) -> None:
        """The entry of op ``name``: where it ran, the outputs it fills, the entries its inputs' values came from."""
        inputs = list(tensors_in((args, kwargs)))
        module = self._where(inputs)
        self._lineage.inherit(module, outputs)
        filled = _FILLED_OUTPUTS.get(name)
        kept = [outputs[i] for i in filled if i < len(outputs)] if filled else outputs
        sources = sorted({i for i in map(self._storages.writer, inputs) if i is not None})  # before it writes
        collective = name.startswith(COLLECTIVES)
        # A collective's arguments name its group, which another stack may number otherwise: not kept.
        self._add(name, module, inputs_text(inputs), kept, sources, collective=collective,
                  arguments="" if collective else arguments_text(func, args, kwargs), package=self._package(module))

    # --- the entries -------------------------------------------------------------------------------------

    def _add(self, name: str, module: str, inputs: str, tensors: list[Any], sources: list[int], *,
             collective: bool = False, as_input: bool = False, arguments: str = "", package: str = "") -> None:
        index = len(self._entries)
        region = self._regions[-1] if self._regions else ""
        self._entries.append((name, module, region, str(self._phase), inputs, [shape_text(t) for t in tensors]))
        self._sources.append(sources)
        self._arguments.append(arguments)
        self._packages.append(package)
        self._digests.append([])
        for tensor in tensors:
            self._storages.wrote(tensor, index, as_input=as_input)
        if collective:  # its outputs are final once the program has waited for it: when it reads them
            for tensor in tensors:
                self._in_flight[id(tensor.untyped_storage())] = (index, tensors)
        else:
            self._pending = (index, tensors)
        if index == self.stack_at:
            self.stack = self._stack_of(index, name, module)

    def _settle(self) -> None:
        """Digest the last op's outputs, once a fault that corrupts them in place has run."""
        if self._pending is not None:
            index, tensors = self._pending
            self._pending = None
            self._digests[index] = [_digest_of(t) for t in tensors]

    def _land(self, inputs: list[Any] | None) -> None:
        """Digest the collectives whose outputs ``inputs`` read (None: all). The program has waited for them by
        then, as its own reads must; the tracer never waits itself (a second wait can redo gloo's copy into the
        output, undoing what came after the first)."""
        storages = {id(t.untyped_storage()) for t in inputs} if inputs is not None else set(self._in_flight)
        for key in storages & set(self._in_flight):
            index, tensors = self._in_flight.pop(key)
            if not self._digests[index]:
                self._digests[index] = [_digest_of(t) for t in tensors]

    def _take_fault_output(self, outputs: list[Any]) -> None:
        """A fault that hands back a new tensor in place of the op's output (``linear_noise``): that tensor is
        the output the rest of the step sees, so it is the one digested."""
        if self._pending is None or not outputs:
            return
        tensors = self._pending[1]
        new = outputs[0]
        if tensors and new.numel() > 1 and new.numel() == tensors[0].numel() and new.dtype == tensors[0].dtype:
            tensors[0] = new
            self._storages.wrote(new, self._pending[0])

    def _backend_copy(self, name: str, args: Any) -> bool:
        """A copy into a collective's output from a buffer no traced op made: how gloo finishes a reduce-scatter
        inside its wait. It is the collective's own work, digested with it, not an op of its own."""
        if name != "aten::copy_" or len(args) < 2 or not self._in_flight:
            return False
        target, source = args[0], args[1]
        return id(target.untyped_storage()) in self._in_flight and not self._storages.was_made(source)

    def _in_fault(self) -> bool:
        return FAULT_REGION in self._regions

    @staticmethod
    def _aliases(func: Any, name: str) -> bool:
        return bool(getattr(func, "is_view", False)) or name in _NO_NEW_VALUES

    def _skips(self, func: Any, name: str) -> bool:
        return self._aliases(func, name) or name in _ALLOCATIONS

    def _package(self, module: str) -> str:
        """Whose code ran the op now running: torch's in an FSDP2 region, the module's under a module label,
        else the first frame past the dispatch plumbing (a loss division in accelerate, clipping, AdamW)."""
        if fsdp_unit(self._regions) is not None:
            return "torch"
        found = self._paths.package_of(module) if self._phase in ("forward", "backward") else None
        return found if found is not None else calling_package()

    def _where(self, inputs: list[Any]) -> str:
        unit = fsdp_unit(self._regions)
        if unit is not None:
            return unit
        if self._phase in ("clip", "optimizer"):
            return self._lineage.name(inputs)
        return self._paths.backward() if self._phase == "backward" else self._paths.forward()

    def _stack_of(self, index: int, name: str, module: str) -> dict[str, Any]:
        import torch

        frames = [f for f in traceback.extract_stack() if not any(part in f.filename for part in _NOT_SHOWN)]
        node = torch._C._current_autograd_node()
        made_at = node.metadata.get("traceback_") if node is not None else None
        return {"rank": self.rank, "index": index, "op": name, "module": module,
                "stack": traceback.format_list(frames[-_STACK_FRAMES:]),
                "forward_stack": list(made_at)[-_STACK_FRAMES:] if made_at else []}

    # --- the record -----------------------------------------------------------------------------------------

    def trace(self) -> RankTrace:
        self._guarded(self._settle)
        self._guarded(self._land, None)
        digests = [[d for d, _ in found] for found in self._digests]
        sketches = [[k for _, k in found] for found in self._digests]
        return RankTrace.of_entries(self._entries, digests, backend=self.backend, hash_kind=HASH_KIND,
                                    seconds=self.seconds, error=self.error, sources=self._sources, sketches=sketches,
                                    arguments=self._arguments, packages=self._packages)

    def store(self, results: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Put this rank's trace (and a kept stack) into a RunRecord's ``results`` and ``arrays``."""
        self.trace().store(self.rank, results, arrays)
        if self.stack is not None:
            results[STACK_KEY] = self.stack


class NoTrace:
    """Steps after step 0, and runs without a tracer: phases that trace nothing."""

    finished = True

    @staticmethod
    def phase(name: str) -> Any:
        return nullcontext()

    def finish(self) -> None:
        pass


def stored(tracer: OpTracer | None, results: dict[str, Any]) -> dict[str, np.ndarray]:
    """A scenario's step-0 trace after training: put into ``results``, its arrays returned ({} without a tracer)."""
    arrays: dict[str, np.ndarray] = {}
    if tracer is not None:
        tracer.store(results, arrays)
    return arrays


def at_step(tracer: OpTracer | None, step: int) -> OpTracer | NoTrace:
    """The tracer for ``step``: ``tracer`` at step 0, else one that traces nothing."""
    return tracer if tracer is not None and step == 0 and not tracer.finished else NoTrace()


def for_rank(ctx: Any, model: Any) -> OpTracer | None:
    """The tracer of a training scenario's rank; in the re-run that explains a failure (config ``STACK_CONFIG``:
    [rank, entry]) it keeps the Python stack of that entry on that rank. None where no trace is compared: a
    recording's noise replicas (config ``perturbation``), triage's experiments (config ``TRACE_CONFIG`` false)."""
    if ctx.config.get("perturbation") or not ctx.config.get(TRACE_CONFIG, True):
        return None
    rank, index = ctx.config.get(STACK_CONFIG) or (None, None)
    return OpTracer(ctx.rank, model, stack_at=int(index) if rank == ctx.rank else None)
