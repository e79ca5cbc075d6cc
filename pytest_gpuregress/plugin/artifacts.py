"""What a training comparison leaves behind to read later: the run's record, its plot, and their paths.

``runs/<name>/<platform-key>/`` (the run, for ``gpuregress compare``) and its ``.png`` plot, and check
scenarios' launch files under ``<scenario>/``. A failed run is always kept and plotted; a passed one only
with --gpuregress-keep-runs or --gpuregress-plots.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from ..comparison.compare import Comparison
from ..comparison.plot import PlotsUnavailable, plot_comparison
from ..reference import store
from ..reference.record import RunRecord


@dataclass
class Kept:
    """Where a comparison's run and plot went, or why there is no plot."""

    run: Path | None = None
    plot: Path | None = None
    plot_note: str | None = None

    def report_lines(self, reference: Path) -> list[str]:
        lines = []
        if self.run is not None:
            lines.append(f"this run's record: {self.run}")
            lines.append(f"reproduce the comparison: {compare_command(reference, self.run)}")
        if self.plot is not None:
            lines.append(f"plot: {self.plot}")
        elif self.plot_note:
            lines.append(f"plot: none ({self.plot_note})")
        return lines


def compare_command(reference: Path | None, run: Path) -> str:
    """The command that judges ``run`` again as the plugin did: against ``reference``, or alone for a check case."""
    return shlex.join(["gpuregress", "compare", *([str(reference)] if reference is not None else []), str(run)])


class Artifacts:
    def __init__(self, root: Path) -> None:
        self.root = root / "runs"

    def keep_run(self, name: str, record: RunRecord) -> Path:
        return store.write_reference(store.ReferenceLocation(self.root, name, record.platform_key), record, overwrite=True)

    def keep(self, name: str, record: RunRecord, reference: RunRecord, comparison: Comparison, *,
             keep_run: bool, plot: bool) -> Kept:
        kept = Kept()
        if keep_run:
            kept.run = self.keep_run(name, record)
        if not plot or not record.series:
            return kept
        try:
            kept.plot = plot_comparison(reference, record, self.root / name / f"{record.platform_key}.png", comparison,
                                        title=name)
        except PlotsUnavailable as exc:
            kept.plot_note = str(exc)
        except Exception as exc:  # noqa: BLE001 - the findings matter more than their picture
            kept.plot_note = f"the plot failed: {type(exc).__name__}: {exc}"
        return kept
