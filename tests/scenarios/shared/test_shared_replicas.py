"""The noise replicas of a training launch (scenarios/shared/replicas.py): its config with each perturbation in
turn, and on a CPU the kernel-path replica's lower ATen capability in its environment."""

from __future__ import annotations

import pytest

from pytest_gpuregress.scenarios.base import Launch, Setup
from pytest_gpuregress.scenarios.shared.replicas import perturbed_launches
from pytest_gpuregress.training import noise

LAUNCH = Launch("default", {"steps": 8, "lr": 3e-3}, {"OMP_NUM_THREADS": "1"})
CAPABILITY = "ATEN_CPU_CAPABILITY"


def replicas(device: str, count: int, lower: str | None, monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """The replicas on ``device`` where this CPU's next lower kernel set is ``lower``."""
    monkeypatch.setattr(noise, "lower_cpu_capability", lambda: lower)
    return perturbed_launches(LAUNCH, Setup(device, "gloo" if device == "cpu" else "nccl", 2), count)  # type: ignore[arg-type]


def test_each_replica_is_the_launch_with_one_perturbation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three replicas, one of each kind: keyed by the perturbation, the launch's config and environment kept, the
    kernel path's replica on the lower CPU kernels; the launch itself untouched."""
    made = replicas("cpu", 3, "avx2", monkeypatch)
    assert [r.key for r in made] == ["replica-weights_ulp_up", "replica-reduction_order", "replica-kernel_path"]
    assert [r.config for r in made] == [{**LAUNCH.config, "perturbation": p} for p in noise.PERTURBATIONS[:3]]
    assert [r.env for r in made] == [LAUNCH.env, LAUNCH.env, {**LAUNCH.env, CAPABILITY: "avx2"}]
    assert "perturbation" not in LAUNCH.config and LAUNCH.env == {"OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(("device", "lower"), [("cpu", None), ("cuda", "avx2")])
def test_no_environment_is_added_where_there_is_no_lower_cpu_path(monkeypatch: pytest.MonkeyPatch, device: str,
                                                                  lower: str | None) -> None:
    """A CPU already on the default kernels has no lower set; a GPU switches its BLAS on the rank instead."""
    assert all(r.env == LAUNCH.env for r in replicas(device, 6, lower, monkeypatch))


@pytest.mark.parametrize("count", [0, 1, 6])
def test_the_count_picks_the_first_perturbations(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """--gpuregress-replicas N: the first N perturbations, in training/noise.py's order (0: no envelope)."""
    made = replicas("cpu", count, "avx2", monkeypatch)
    assert [r.config["perturbation"] for r in made] == list(noise.PERTURBATIONS[:count])
