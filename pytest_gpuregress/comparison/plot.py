"""One figure per comparison: the curves with the tolerance band, deviation per step against each limit,
and the worst parameters. matplotlib is optional: without it ``plot_comparison`` raises
``PlotsUnavailable`` naming the install command.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import GpuRegressError
from ..reference import by_name
from ..reference.record import RunRecord
from .compare import Comparison, compare_training, tolerant_limits
from .envelope import rel

INSTALL_HINT = "pip install 'pytest-gpuregress[plots]'"
WORST_PARAMETERS = 10


class PlotsUnavailable(GpuRegressError):
    """matplotlib is not installed."""


def _pyplot():  # noqa: ANN202 - matplotlib's module, imported only when a plot is drawn
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(f"plots need matplotlib: {INSTALL_HINT}") from None
    matplotlib.use("Agg")  # files only, never a window: this runs in CI
    import matplotlib.pyplot as plt

    return plt


def first_divergence(comparison: Comparison | None) -> int | None:
    steps = [f.step for f in (comparison.findings if comparison else []) if f.step is not None]
    return min(steps) if steps else None


def plot_comparison(reference: RunRecord, run: RunRecord | None, path: Path, comparison: Comparison | None = None,
                    title: str = "") -> Path:
    """Draw the figure into ``path`` (PNG); ``run`` None draws the reference and its band alone."""
    plt = _pyplot()
    if run is not None and comparison is None:
        comparison = compare_training(reference, run)
    limits, source = tolerant_limits(reference)
    diverged = first_divergence(comparison)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for ax, metric in zip(axes[0], ("loss", "grad_norm")):
        _curves(ax, metric, reference, run, np.asarray(limits[metric], dtype=np.float64), diverged)
    _deviation(axes[1][0], reference, run, limits, diverged)
    _worst_parameters(axes[1][1], reference, run, limits)
    band = "K x envelope + floor" if source == "envelope" else "fixed limits"
    fig.suptitle(f"{title or reference.scenario} {reference.platform_key}: tolerance from {band}"
                 + (f"; {comparison.lane} lane, {'PASSED' if comparison.passed else 'FAILED'}" if comparison else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)  # a reader never sees half a PNG
    return path


def _curves(ax, metric: str, reference: RunRecord, run: RunRecord | None, limit: np.ndarray,  # noqa: ANN001
            diverged: int | None) -> None:
    ref = np.asarray(reference.series.get(metric, []), dtype=np.float64)
    steps = np.arange(len(ref))
    if not len(ref):
        ax.set_title(f"{metric}: not recorded")
        return
    width = np.broadcast_to(limit, ref.shape) * np.abs(ref)
    ax.fill_between(steps, ref - width, ref + width, color="tab:blue", alpha=0.25, label="tolerance band")
    ax.plot(steps, ref, color="tab:blue", lw=1.2, label="reference")
    if run is not None:
        got = np.asarray(run.series.get(metric, []), dtype=np.float64)
        ax.plot(np.arange(len(got)), got, color="tab:red", lw=1.0, ls="--", label="this run")
    if diverged is not None:
        ax.axvline(diverged, color="black", lw=0.8, ls=":", label=f"first divergence (step {diverged})")
    ax.set_title(metric.replace("_", " "))
    ax.set_xlabel("step")
    ax.legend(fontsize=8)


def _deviation(ax, reference: RunRecord, run: RunRecord | None, limits: dict,  # noqa: ANN001
               diverged: int | None) -> None:
    for metric, color in (("loss", "tab:blue"), ("grad_norm", "tab:orange")):
        ref = np.asarray(reference.series.get(metric, []), dtype=np.float64)
        if not len(ref):
            continue
        limit = np.broadcast_to(np.asarray(limits[metric], dtype=np.float64), ref.shape)
        ax.semilogy(np.arange(len(ref)), limit, color=color, lw=1.0, ls="--", label=f"{metric} limit")
        if run is not None:
            got = np.asarray(run.series.get(metric, []), dtype=np.float64)[: len(ref)]
            dev = rel(got, ref[: len(got)])
            ax.semilogy(np.arange(len(got)), np.maximum(dev, 1e-12), color=color, lw=1.0, label=f"{metric} deviation")
    if diverged is not None:
        ax.axvline(diverged, color="black", lw=0.8, ls=":")
    ax.set_title("relative deviation per step (1e-12 = bitwise equal)")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)


def _worst_parameters(ax, reference: RunRecord, run: RunRecord | None, limits: dict) -> None:  # noqa: ANN001
    ref, got = reference.arrays.get("param_grad_norm"), by_name.param_grad_norms(reference, run)[0] if run else None
    if ref is None or got is None:
        return _no_bars(ax, "gradient norms per parameter: no run to compare")
    if ref.shape[1:] != got.shape[1:] or sorted(run.param_names) != sorted(reference.param_names):  # type: ignore[union-attr]
        # the model's code changed its parameters (a [model] finding): there is no parameter to pair with its own
        return _no_bars(ax, f"gradient norms per parameter: {ref.shape[1]} parameters in the reference, {got.shape[1]} "
                        "in this run: the model's layout changed", fontsize=9)
    steps = min(len(ref), len(got))
    ratio = rel(got[:steps], ref[:steps]) / np.asarray(limits["param_grad_norm"], dtype=np.float64)[:steps]
    worst = np.nanmax(ratio, axis=0) if steps else np.zeros(ref.shape[1])
    _bars(ax, reference.param_names or [f"param{i}" for i in range(len(worst))], worst)


def _bars(ax, names: list[str], worst: np.ndarray) -> None:  # noqa: ANN001
    """The parameters' worst deviations as multiples of their limits, the largest WORST_PARAMETERS: red past 1."""
    order = np.argsort(-worst)[:WORST_PARAMETERS][::-1]
    ax.barh([names[i] for i in order], np.maximum(worst[order], 1e-6),
            color=["tab:red" if worst[i] > 1 else "tab:green" for i in order])
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_title("worst gradient-norm deviation (x limit; > 1 fails)")
    ax.tick_params(axis="y", labelsize=7)


def _no_bars(ax, title: str, **font: float) -> None:  # noqa: ANN001
    ax.set_title(title, **font)
    ax.axis("off")
