"""The job a group of ranks runs, and the files through which ranks report back (docs/launching.md).

Everything that crosses the process boundary is text or JSON; torch's own flight-recorder dump is the one
pickle, read without unpickling.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..kinds import Backend, DeviceKind


@dataclass
class Job:
    """What every rank of one group runs."""

    scenario: str  # the rank entry, "package.module:function", run as function(ctx) -> RunRecord
    config: dict[str, Any]
    world_size: int
    device_kind: DeviceKind
    backend: Backend
    run_dir: str
    timeout_s: float  # per-collective timeout given to the process group
    faults: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for this group only
    loopback_only: bool = True  # single-machine runs bind every socket to the loopback interface
    collect_fingerprint: bool = True
    watch: dict[str, Any] = field(default_factory=dict)  # --gpuregress-fail-fast (comparison/failfast.py)
    fresh_ranks: bool = False  # new processes for this job, not pooled ones
    profile: bool = True  # training loops take a kernel inventory of a few steps (training/observe.py)
    cwd: str = ""  # the launcher's working directory: ranks import a user's modules from it

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: Path) -> Job:
        return cls(**json.loads(path.read_text()))


class RankFiles:
    """Paths one rank writes in the run directory."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.record_dir = run_dir / f"rank{rank}"
        self.progress = run_dir / f"rank{rank}.progress"
        self.done = run_dir / f"rank{rank}.done"  # the record is written: a crash from here on loses nothing
        self.released = run_dir / f"rank{rank}.released"  # torn down: the rank may serve another job
        self.error = run_dir / f"rank{rank}.error.json"
        self.stack = run_dir / f"rank{rank}.stack"
        self.flight = run_dir / f"rank{rank}.flight"
        self.device_error = run_dir / f"rank{rank}.device_error"
        self.log = run_dir / f"rank{rank}.log"

    def last_progress(self) -> str | None:
        try:
            lines = self.progress.read_text().splitlines()
        except OSError:
            return None
        return lines[-1] if lines else None
