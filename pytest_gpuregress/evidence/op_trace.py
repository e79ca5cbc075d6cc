"""The op trace of step 0 as a RunRecord keeps it, per rank: torch-free, numpy only.

evidence/op_tracer.py records it, first_moved.py compares two; every rank's trace is kept (``merge_ranks``).
The layout in ``results`` and ``arrays``: docs/architecture.md, "The op trace's layout".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

import numpy as np

from ..reference.record import RunRecord

RESULT_KEY = "op_trace"
STACK_KEY = "op_trace_stack"  # the Python stack of one entry, kept by the re-run that explains a failure
STACK_CONFIG = "op_trace_stack_at"  # that re-run's config key: [rank, entry index]
TRACE_CONFIG = "op_trace"  # a launch config key: false where no trace is compared (triage's experiments)
ARRAY_PREFIX = "op_trace/"
PHASES = ("forward", "backward", "clip", "optimizer")
INPUT_OP = "<input>"
COLLECTIVES = ("c10d::", "_c10d_functional::", "c10d_functional::")  # ops whose outputs hold other ranks' inputs
ROOT = "(root)"  # the module path of the model itself, and of FSDP2's root unit; "" is no module at all
FORMAT = 1
_OP, _MODULE, _REGION, _PHASE, _INPUTS, _OUTPUTS = range(6)


@dataclass(frozen=True)
class TraceOp:
    """One entry of a rank's trace, read back."""

    index: int
    op: str
    module: str
    region: str
    phase: str
    inputs: str
    outputs: tuple[str, ...]
    digests: np.ndarray  # [outputs, 3]: sum, sum of |x|, max |x|
    hashes: np.ndarray  # [outputs]
    sketches: tuple[np.ndarray | None, ...] = ()  # per output: its bucket sums (float64), or None where none is kept
    arguments: str | None = None  # its non-tensor arguments ("other=0.5"); None in traces recorded before they were
    package: str | None = None  # the package whose code ran it ("peft", "accelerate", "torch"); None as above

    @property
    def identity(self) -> tuple[str, ...]:
        """What must match for two entries to be the same op: a difference here is a changed op sequence."""
        return (self.op, self.module, self.phase, self.inputs, *self.outputs)


@dataclass
class RankTrace:
    strings: list[str]
    ops: np.ndarray  # int32 [ops, 6]
    outputs: np.ndarray  # int32 [outputs]
    digests: np.ndarray  # float64 [outputs, 3]
    hashes: np.ndarray  # int64 [outputs]
    backend: str = ""
    hash_kind: str = ""
    seconds: float = 0.0
    error: str | None = None  # why the rank side stopped tracing (a bug of the tracer): not compared
    source_counts: np.ndarray | None = None  # int32 [ops]; None in traces recorded before sources were kept
    sources: np.ndarray | None = None  # int32 [sum of source_counts]
    sketch: np.ndarray | None = None  # float32 [sketched outputs, buckets]; None in traces recorded before sketches
    sketch_rows: np.ndarray | None = None  # int32 [outputs]: each output's row of ``sketch``, -1 for none
    arguments: np.ndarray | None = None  # int32 [ops]: string index of each op's non-tensor arguments; None: not kept
    packages: np.ndarray | None = None  # int32 [ops]: string index of the package whose code ran each op

    def __post_init__(self) -> None:
        self.ops = np.asarray(self.ops, dtype=np.int32).reshape(-1, 6)
        self.outputs = np.asarray(self.outputs, dtype=np.int32).reshape(-1)
        self._first = np.concatenate([[0], np.cumsum(self.ops[:, _OUTPUTS], dtype=np.int64)])
        if self.source_counts is not None and self.sources is not None:
            self.source_counts = np.asarray(self.source_counts, dtype=np.int32).reshape(-1)
            self.sources = np.asarray(self.sources, dtype=np.int32).reshape(-1)
            self._first_source = np.concatenate([[0], np.cumsum(self.source_counts, dtype=np.int64)])
        else:
            self.source_counts = self.sources = None
        if self.sketch is not None and self.sketch_rows is not None and len(self.sketch_rows) == len(self.outputs):
            sketch = np.asarray(self.sketch, dtype=np.float32)
            self.sketch = sketch if sketch.ndim == 2 else sketch.reshape(len(sketch), -1 if sketch.size else 0)
            self.sketch_rows = np.asarray(self.sketch_rows, dtype=np.int32).reshape(-1)
        else:
            self.sketch = self.sketch_rows = None
        self.arguments = _per_op(self.arguments, len(self.ops))
        self.packages = _per_op(self.packages, len(self.ops))

    @property
    def has_sources(self) -> bool:
        return self.sources is not None and len(self.source_counts) == len(self.ops)  # type: ignore[arg-type]

    def sources_of(self, index: int) -> tuple[int, ...]:
        """The entries whose values entry ``index``'s inputs hold (() for a trace without sources)."""
        if not self.has_sources:
            return ()
        first, last = int(self._first_source[index]), int(self._first_source[index + 1])
        return tuple(int(i) for i in self.sources[first:last])  # type: ignore[index]

    @classmethod
    def of_entries(cls, entries: Sequence[tuple[str, str, str, str, str, list[str]]],
                   digests: Sequence[Sequence[tuple[float, float, float, int]]], *, backend: str, hash_kind: str,
                   seconds: float, error: str | None = None, sources: Sequence[Sequence[int]] | None = None,
                   sketches: Sequence[Sequence[np.ndarray | None]] | None = None,
                   arguments: Sequence[str] | None = None, packages: Sequence[str] | None = None) -> RankTrace:
        """From the rank side's entries (op, module, region, phase, inputs, output shapes), their digests and,
        where kept, their outputs' sketches and each op's arguments and package."""
        table: dict[str, int] = {}

        def at(text: str) -> int:
            return table.setdefault(text, len(table))

        ops, outputs, digested, kept_rows = [], [], [], []
        for (op, module, region, phase, inputs, shapes), found, kept in zip(
                entries, digests, sketches if sketches is not None else repeat(())):
            ops.append([at(op), at(module), at(region), at(phase), at(inputs), len(shapes)])
            outputs += map(at, shapes)
            # an output never digested (its op raised) reads as NaN; one never sketched keeps no row
            digested += [*found, *[(np.nan, np.nan, np.nan, 0)] * len(shapes)][:len(shapes)]
            kept_rows += [*kept, *[None] * len(shapes)][:len(shapes)]
        sketch = [row for row in kept_rows if row is not None]
        present = np.array([row is not None for row in kept_rows], dtype=bool)
        sketch_rows = np.where(present, np.cumsum(present) - 1, -1).astype(np.int32)
        width = len(sketch[0]) if sketch else 0
        kept = (_kept(sources, lambda found: list(map(len, found))),
                _kept(sources, lambda found: list(chain.from_iterable(found))),
                _kept(sketches, lambda _: np.array(sketch, dtype=np.float32).reshape(len(sketch), width)),
                _kept(sketches, lambda _: sketch_rows),
                _kept(arguments, lambda found: list(map(at, found))),  # before the strings are read off the table
                _kept(packages, lambda found: list(map(at, found))))
        return cls(list(table), np.array(ops), np.array(outputs),
                   np.array([d[:3] for d in digested], dtype=np.float64).reshape(-1, 3),
                   np.array([d[3] for d in digested], dtype=np.int64), backend, hash_kind, seconds, error, *kept)

    def __len__(self) -> int:
        return len(self.ops)

    def entry(self, index: int) -> TraceOp:
        row = [int(i) for i in self.ops[index]]
        first, last = int(self._first[index]), int(self._first[index + 1])
        text = self.strings
        sketches: tuple[np.ndarray | None, ...] = ()
        if self.sketch is not None:  # __post_init__ keeps sketch and sketch_rows both or neither
            sketches = tuple(self.sketch[r].astype(np.float64) if r >= 0 else None
                             for r in self.sketch_rows[first:last])
        arguments = text[int(self.arguments[index])] if self.arguments is not None else None
        package = text[int(self.packages[index])] if self.packages is not None else None
        return TraceOp(index, text[row[_OP]], text[row[_MODULE]], text[row[_REGION]], text[row[_PHASE]],
                       text[row[_INPUTS]], tuple(text[int(i)] for i in self.outputs[first:last]),
                       self.digests[first:last], self.hashes[first:last], sketches, arguments, package)

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, "backend": self.backend, "hash": self.hash_kind, "seconds": round(self.seconds, 4),
               "strings": self.strings}
        return {**out, "error": self.error} if self.error else out

    def arrays(self, rank: int) -> dict[str, np.ndarray]:
        prefix = f"{ARRAY_PREFIX}rank{rank}/"
        out = {prefix + "ops": self.ops, prefix + "outputs": self.outputs, prefix + "digest": self.digests,
               prefix + "hash": self.hashes}
        if self.has_sources:
            out.update({prefix + "source_counts": self.source_counts, prefix + "sources": self.sources})
        if self.sketch is not None:
            out.update({prefix + "sketch": self.sketch, prefix + "sketch_rows": self.sketch_rows})
        if self.arguments is not None and self.packages is not None:
            out.update({prefix + "arguments": self.arguments, prefix + "packages": self.packages})
        return out

    def store(self, rank: int, results: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        results.setdefault(RESULT_KEY, {"ranks": {}})["ranks"][str(rank)] = self.to_json()
        arrays.update(self.arrays(rank))

    def nbytes(self) -> int:
        """What this trace adds to a record: its JSON as the store writes it (indented) and its arrays."""
        from ..reference.atomic import dump_json

        return len(dump_json(self.to_json())) + sum(a.nbytes for a in self.arrays(0).values())


def _per_op(indices: np.ndarray | None, ops: int) -> np.ndarray | None:
    """A per-op column of string indices, or None where it is missing or does not fit (an older trace)."""
    if indices is None:
        return None
    kept = np.asarray(indices, dtype=np.int32).reshape(-1)
    return kept if len(kept) == ops else None


def ranks(record: RunRecord) -> dict[int, RankTrace]:
    """Every rank's trace in ``record``; {} for a record without one (older, or of a scenario that keeps none)."""
    stored = record.results.get(RESULT_KEY)
    if not isinstance(stored, dict):
        return {}
    out: dict[int, RankTrace] = {}
    for key, data in stored.get("ranks", {}).items():
        found = [record.arrays.get(f"{ARRAY_PREFIX}rank{key}/{name}") for name in (
            "ops", "outputs", "digest", "hash", "source_counts", "sources", "sketch", "sketch_rows", "arguments",
            "packages")]
        if any(a is None for a in found[:4]) or data.get("format") != FORMAT or data.get("error"):
            continue  # a trace of another format, or one the rank could not finish: nothing to compare
        ops, outputs, digest, hashes, *kept = found
        out[int(key)] = RankTrace(list(data["strings"]), ops, outputs, np.asarray(digest, dtype=np.float64).reshape(-1, 3),
                                  np.asarray(hashes, dtype=np.int64), str(data.get("backend", "")),
                                  str(data.get("hash", "")), float(data.get("seconds", 0.0)), None, *kept)
    return out


def merge_ranks(records: list[RunRecord]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Every rank's trace and kept stack, for the merged record: (its ``results`` part, its ``arrays`` part)."""
    traces: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    results: dict[str, Any] = {}
    for record in records:
        stored = record.results.get(RESULT_KEY)
        if isinstance(stored, dict):
            traces.update(stored.get("ranks", {}))
        arrays.update({k: v for k, v in record.arrays.items() if k.startswith(ARRAY_PREFIX)})
        if STACK_KEY in record.results:
            results[STACK_KEY] = record.results[STACK_KEY]
    if traces:
        results[RESULT_KEY] = {"ranks": dict(sorted(traces.items(), key=lambda kv: int(kv[0])))}
    return results, arrays


def _kept(values: Sequence[Any] | None, rows: Callable[[Sequence[Any]], Any]) -> np.ndarray | None:
    """``rows(values)`` as an int32 array (unless already an array), where the rank kept ``values``; else None."""
    if values is None:
        return None
    found = rows(values)
    return found if isinstance(found, np.ndarray) else np.array(found, dtype=np.int32)

