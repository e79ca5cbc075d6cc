"""What a scenario is, and what it gets on each rank.

A scenario is a training or checking procedure that runs on every rank of a process group and
returns a RunRecord. It knows nothing of pytest. The launcher gives it a RankContext; the plugin
compares what it returns. A user's own training loop plugs in through ``FunctionScenario``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..record import RunRecord

StepHook = Callable[[int, int], None]  # (rank, step) -> None; faults use it to hang or crash


@dataclass
class RankContext:
    """Everything a scenario needs to know about where it runs."""

    rank: int
    world_size: int
    local_rank: int
    device_kind: str  # "cpu" or "cuda"
    backend: str
    config: dict[str, Any]
    run_dir: Path
    fingerprint: dict[str, Any] = field(default_factory=dict)
    step_hooks: list[StepHook] = field(default_factory=list)
    teardown_hooks: list[Callable[[], None]] = field(default_factory=list)
    progress_path: Path | None = None

    @property
    def device(self) -> str:
        return f"cuda:{self.local_rank}" if self.device_kind == "cuda" else "cpu"

    def progress(self, label: str) -> None:
        """Append a progress line; the last one is reported if this rank hangs."""
        if self.progress_path is not None:
            with open(self.progress_path, "a") as fh:
                fh.write(label + "\n")

    def step_done(self, step: int) -> None:
        """Call after each completed step: records progress and lets injected faults fire."""
        self.progress(f"step {step} done")
        for hook in self.step_hooks:
            hook(self.rank, step)


class Scenario(Protocol):
    """A named procedure run on every rank; see FsdpScenario for a complete example."""

    name: str

    def default_config(self, device_kind: str, steps: int | None) -> dict[str, Any]:
        """The configuration this scenario runs with on ``device_kind``; stored with references."""
        ...

    def platform_tag(self, config: dict[str, Any]) -> str:
        """Short tag for the reference directory, e.g. the compute dtype."""
        ...

    def run(self, ctx: RankContext) -> RunRecord:
        """Run on one rank inside an initialised process group."""
        ...

    def merge(self, records: list[RunRecord]) -> RunRecord:
        """Combine the per-rank records (index = rank) into the one that is compared."""
        ...


def merge_rank0(records: list[RunRecord]) -> RunRecord:
    """For scenarios whose rank-0 record already holds global values (losses are all-reduced)."""
    return records[0]


@dataclass
class FunctionScenario:
    """Wraps a user's ``def train(ctx: RankContext) -> RunRecord`` found by "module:function"."""

    entry: str
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    tag: str = "fp32"

    def __post_init__(self) -> None:
        self.name = self.name or self.entry.rsplit(":", 1)[-1]

    def default_config(self, device_kind: str, steps: int | None) -> dict[str, Any]:
        cfg = dict(self.config)
        if steps is not None:
            cfg.setdefault("steps", steps)
        return cfg

    def platform_tag(self, config: dict[str, Any]) -> str:
        return str(config.get("dtype", self.tag))

    def run(self, ctx: RankContext) -> RunRecord:
        return resolve_entry(self.entry)(ctx)

    def merge(self, records: list[RunRecord]) -> RunRecord:
        return merge_rank0(records)


def resolve_entry(entry: str) -> Any:
    """Import ``"package.module:attr"``; a clear error names what was not found."""
    module_name, _, attr = entry.partition(":")
    if not attr:
        raise ValueError(f"scenario entry {entry!r} must look like 'package.module:function'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"scenario entry {entry!r}: module {module_name} has no attribute {attr!r}") from None
