"""The flight recorder: each rank's current collective, and the line that names whom a hung group waits for."""

from __future__ import annotations

from pathlib import Path

import torch

from pytest_gpuregress.launch import flight
from pytest_gpuregress.launch.flight import FlightState


def test_the_state_file_says_which_collective_a_rank_is_in(tmp_path: Path) -> None:
    recorder = flight.FlightRecorder(tmp_path / "rank0.flight")
    seen: list[FlightState | None] = []

    def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor) -> None:
        seen.append(flight.read(tmp_path / "rank0.flight", 0))  # what the launcher would read during the call

    wrapped = recorder.wrap("all_gather_into_tensor", all_gather_into_tensor)
    wrapped(torch.zeros(2048), torch.zeros(1024))
    wrapped(torch.zeros(8), torch.zeros(4))
    after = flight.read(tmp_path / "rank0.flight", 0)
    recorder.close()
    assert seen[0] == FlightState(0, True, "all_gather", 1, 8192)
    assert seen[1] == FlightState(0, True, "all_gather", 2, 32)
    assert after is not None and not after.inside and after.seq == 2


def test_a_rank_outside_any_collective_is_named_as_the_one_the_others_wait_for() -> None:
    states = {0: FlightState(0, True, "all_gather", 57, 65536), 1: FlightState(1, False, "all_gather", 56, 0)}
    line = flight.diagnose(states, {0: "step 2 done", 1: "step 2 done"})
    assert line == ("rank 0 waits in all_gather #57 (64 KiB) for rank 1; "
                    "rank 1 stopped outside any collective (last: all_gather #56), after step 2 done")


def test_a_rank_behind_in_the_sequence_is_named_too() -> None:
    states = {0: FlightState(0, True, "reduce_scatter", 9, 1024), 1: FlightState(1, True, "reduce_scatter", 9, 1024),
              2: FlightState(2, True, "all_gather", 7, 1024), 3: None}
    line = flight.diagnose(states, {2: "step 0 done", 3: None})
    assert line is not None
    assert line.startswith("rank 0 waits in reduce_scatter #9 (1 KiB) for rank 2, 3; rank 1 waits")
    assert "rank 2 is in an earlier collective, all_gather #7 (1 KiB) (step 0 done)" in line
    assert "rank 3 never entered a collective (no progress)" in line


def test_every_rank_in_the_same_collective_points_at_the_transport() -> None:
    states = {r: FlightState(r, True, "all_reduce", 3, 4) for r in range(2)}
    assert "the transport itself is stuck" in (flight.diagnose(states, {}) or "")


def test_no_rank_in_a_collective_gives_no_line() -> None:
    assert flight.diagnose({0: None, 1: FlightState(1, False, "all_reduce", 3, 0)}, {}) is None
