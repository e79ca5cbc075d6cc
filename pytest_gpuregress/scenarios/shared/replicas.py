"""The noise replicas of a training launch: its config with a legitimate ``perturbation`` the rank code applies
(training/noise.py); their spread is the tolerant lane's envelope. Session side, torch-free."""

from __future__ import annotations

from ..base import Launch, Setup


def perturbed_launches(launch: Launch, setup: Setup, count: int) -> list[Launch]:
    """The noise replicas of a training launch: its config with a ``perturbation`` the rank code applies."""
    from ...training.noise import replica_plan

    return [Launch(f"replica-{perturbation}", {**launch.config, "perturbation": perturbation}, {**launch.env, **env})
            for perturbation, env in replica_plan(count, setup.device_kind)]
