"""comparison/policy.py: a kept run's policy round-trips, so `gpuregress compare` judges it as the plugin did."""

from __future__ import annotations

from pytest_gpuregress.comparison.policy import JudgingPolicy


def test_a_policy_round_trips_through_json_and_ignores_a_newer_versions_keys() -> None:
    policy = JudgingPolicy(lane="exact", kernel_changes="fail", perf="fail", perf_slowdown=2.0, perf_memory=1.1)
    assert JudgingPolicy.from_json(policy.to_json()) == policy
    assert JudgingPolicy.from_json({**policy.to_json(), "added_later": 1}) == policy
    assert JudgingPolicy.from_json({}) == JudgingPolicy()
