"""The flips' cold control (triage/flips.py): a run with nothing flipped, in a fresh process. Where it passes, the
failure needs a warmed-up process, and no flipped run (as fresh) may convict its switch; it runs only where a flip
vanished, the only case it can overrule."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pytest_gpuregress.triage import flips

FAILING = SimpleNamespace(margins={"loss": 50.0}, passed=False)
PASSING = SimpleNamespace(margins={"loss": 0.2}, passed=True)


class _Scenario:
    def model_config(self, setup: Any, model: str | None) -> dict[str, object]:
        return {"steps": 8}


def _flip(monkeypatch: pytest.MonkeyPatch, outcome: dict[str, Any]) -> tuple[list[flips.Experiment], list[str]]:
    """Flip two switches; ``outcome``: the comparison each launch (by name) gives. The launches made, in order."""
    launched: list[str] = []
    monkeypatch.setattr(flips, "switches", lambda setup: [flips.Switch("kernel path", "kernel"),
                                                          flips.Switch("world size 1", "collective", world_size=1)])
    monkeypatch.setattr(flips, "compare_training", lambda reference, run, lane: outcome[run])

    def run(sc: Any, launch: Any) -> str:
        launched.append(launch.key)
        assert launch.cold, launch.key  # every flip and the control start in fresh processes
        return launch.key

    return flips.flip(_Scenario(), SimpleNamespace(), run, SimpleNamespace(), FAILING), launched  # type: ignore[arg-type]


def test_a_control_that_passes_overrules_the_flip_that_vanished(monkeypatch: pytest.MonkeyPatch) -> None:
    found, launched = _flip(monkeypatch, {"flip-kernel path": FAILING, "flip-world size 1": PASSING,
                                          "flip-none": PASSING})
    assert launched == ["flip-kernel path", "flip-world size 1", "flip-none"]
    assert [(e.name, e.status) for e in found] == [("flips", "not applicable")]
    assert "needs a warmed-up process" in found[0].detail and found[0].component is None


def test_a_control_that_fails_leaves_the_flips_to_convict(monkeypatch: pytest.MonkeyPatch) -> None:
    found, _ = _flip(monkeypatch, {"flip-kernel path": FAILING, "flip-world size 1": PASSING, "flip-none": FAILING})
    assert [(e.name, e.status, e.component) for e in found] == [("flip kernel path", "stayed", None),
                                                               ("flip world size 1", "vanished", "collective")]


def test_no_control_runs_where_no_flip_vanished(monkeypatch: pytest.MonkeyPatch) -> None:
    found, launched = _flip(monkeypatch, {"flip-kernel path": FAILING, "flip-world size 1": FAILING})
    assert launched == ["flip-kernel path", "flip-world size 1"]
    assert all(e.status == "stayed" and e.component is None for e in found)
