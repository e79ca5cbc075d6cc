"""The flight recorder: each rank's current collective, and the line that names whom a hung group waits for."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
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
    assert (states[0].label, states[1].label) == ("all_gather #57 (64 KiB)", "all_gather #56")
    waits, stopped = line.split("; ")
    assert waits == f"rank 0 waits in {states[0].label} for rank 1"
    assert stopped.startswith("rank 1 stopped outside any collective (")
    assert stopped.endswith(f"(last: {states[1].label}), after step 2 done")


def test_a_rank_behind_in_the_sequence_is_named_too() -> None:
    states = {0: FlightState(0, True, "reduce_scatter", 9, 1024), 1: FlightState(1, True, "reduce_scatter", 9, 1024),
              2: FlightState(2, True, "all_gather", 7, 1024), 3: None}
    line = flight.diagnose(states, {2: "step 0 done", 3: None})
    assert line is not None
    parts = line.split("; ")
    assert states[0].label == "reduce_scatter #9 (1 KiB)"
    assert parts[0] == f"rank 0 waits in {states[0].label} for rank 2, 3" and parts[1].startswith("rank 1 waits")
    assert f"rank 2 is in an earlier collective, {states[2].label} (step 0 done)" in parts
    assert any(p.startswith("rank 3 never entered") and p.endswith("(no progress)") for p in parts), parts


def test_every_rank_in_the_same_collective_points_at_the_transport() -> None:
    states = {r: FlightState(r, True, "all_reduce", 3, 4) for r in range(2)}
    assert "the transport itself is stuck" in (flight.diagnose(states, {}) or "")


def test_no_rank_in_a_collective_gives_no_line() -> None:
    assert flight.diagnose({0: None, 1: FlightState(1, False, "all_reduce", 3, 0)}, {}) is None


class FakeWork:
    """What NCCL hands back: queued on the GPU stream, finished only when the device says so."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waited += 1  # on NCCL the stream waits, the host does not: a hung GPU never blocks here
        return True


def queued_all_reduce(works: list[FakeWork]) -> Callable[..., FakeWork | None]:
    """A stand-in for dist.all_reduce on NCCL: every call queues a FakeWork."""

    def all_reduce(tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False) -> FakeWork | None:
        works.append(FakeWork())
        return works[-1] if async_op else None  # the plain call leaves the stream waiting and returns None

    return all_reduce


def stream_events(works: list[FakeWork]) -> Callable[[], Callable[[], bool]]:
    """A stand-in for the CUDA event recorded after a plain call: done when that call's queued work is."""
    return lambda: works[-1].is_completed


def queued_recorder(path: Path, works: list[FakeWork]) -> flight.FlightRecorder:
    return flight.FlightRecorder(path, queued=True, poll_s=None, stream_marker=stream_events(works))


def test_gloo_keeps_its_path_and_nccl_or_rccl_read_completion_from_the_work() -> None:
    assert not flight.queues_work("gloo") and not flight.queues_work(None)
    assert flight.queues_work("nccl") and flight.queues_work("rccl") and flight.queues_work("cpu:gloo,cuda:nccl")


def test_a_queued_but_unfinished_nccl_collective_keeps_the_rank_inside_it(tmp_path: Path) -> None:
    path = tmp_path / "rank0.flight"
    works: list[FakeWork] = []
    recorder = queued_recorder(path, works)
    assert recorder.queued is flight.queues_work("nccl")
    all_reduce = recorder.wrap("all_reduce", queued_all_reduce(works))
    assert all_reduce(torch.zeros(4)) is None  # returned at once, as NCCL does
    assert works[0].waited == 0  # the call was made as the caller made it: nothing waited behind its back
    assert flight.read(path, 0) == FlightState(0, True, "all_reduce", 1, 16)  # gloo's path would say "out" here
    all_reduce(torch.zeros(8))
    recorder.refresh()
    assert flight.read(path, 0) == FlightState(0, True, "all_reduce", 1, 16)  # the oldest one the GPU has not finished
    works[0].done = True
    recorder.refresh()
    assert flight.read(path, 0) == FlightState(0, True, "all_reduce", 2, 32)
    works[1].done = True
    recorder.refresh()
    assert flight.read(path, 0) == FlightState(0, False, "all_reduce", 2, 0)
    recorder.close()


def test_a_hung_gpu_collective_names_the_rank_that_never_queued_it(tmp_path: Path) -> None:
    works: list[FakeWork] = []
    recorders = [queued_recorder(tmp_path / f"rank{r}.flight", works) for r in range(2)]
    calls = [recorder.wrap("all_reduce", queued_all_reduce(works)) for recorder in recorders]
    calls[0](torch.zeros(4))
    calls[1](torch.zeros(4))
    works[0].done = works[1].done = True  # step 1's all-reduce finished on both GPUs
    calls[0](torch.zeros(4))  # rank 0 queues #2; rank 1 stopped before it, so #2 never finishes on rank 0's GPU
    for recorder in recorders:
        recorder.refresh()
    states = {r: flight.read(tmp_path / f"rank{r}.flight", r) for r in range(2)}
    for recorder in recorders:
        recorder.close()
    assert flight.diagnose(states, {0: "step 1 done", 1: "step 1 done"}) == (
        "rank 0 waits in all_reduce #2 (16 B) for rank 1; "
        "rank 1 stopped outside any collective (last: all_reduce #1), after step 1 done")


def test_a_caller_asking_for_async_op_gets_its_work_and_completion_is_read_from_it(tmp_path: Path) -> None:
    path = tmp_path / "rank0.flight"
    works: list[FakeWork] = []
    recorder = flight.FlightRecorder(path, queued=True, poll_s=None, stream_marker=lambda: None)
    all_reduce = recorder.wrap("all_reduce", queued_all_reduce(works))
    assert all_reduce(torch.zeros(4), None, None, True) is works[0]  # async_op given positionally
    assert all_reduce(torch.zeros(4), async_op=True) is works[1]
    assert works[0].waited == works[1].waited == 0  # the caller waits itself
    recorder.refresh()
    assert flight.read(path, 0) == FlightState(0, True, "all_reduce", 1, 16)
    works[0].done = works[1].done = True
    recorder.refresh()
    assert flight.read(path, 0) == FlightState(0, False, "all_reduce", 2, 0)
    assert all_reduce(torch.zeros(4)) is None  # a plain call with no CUDA to mark the stream: done on return
    assert flight.read(path, 0) == FlightState(0, False, "all_reduce", 3, 0)
    recorder.close()


def test_inside_torch_compile_the_recorder_steps_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    works: list[FakeWork] = []
    recorder = queued_recorder(tmp_path / "rank0.flight", works)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    recorder.wrap("all_reduce", queued_all_reduce(works))(torch.zeros(4))
    assert recorder.seq == 0 and len(works) == 1
    recorder.close()


def test_a_collective_that_raises_leaves_the_rank_outside_it(tmp_path: Path) -> None:
    path = tmp_path / "rank0.flight"
    recorder = flight.FlightRecorder(path, queued=True, poll_s=None)

    def broadcast(tensor: torch.Tensor, src: int = 0, group: object = None, async_op: bool = False) -> None:
        raise RuntimeError("NCCL error")

    try:
        recorder.wrap("broadcast", broadcast)(torch.zeros(2))
    except RuntimeError:
        pass
    assert flight.read(path, 0) == FlightState(0, False, "broadcast", 1, 0)
    recorder.close()


def test_install_on_nccl_polls_completion_in_a_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    works: list[FakeWork] = []
    monkeypatch.setattr(dist, "all_reduce", queued_all_reduce(works))
    monkeypatch.setattr(flight, "_cuda_stream_marker", stream_events(works))
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "")  # so that monkeypatch restores what was there
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE")
    hooks: list[Callable[[], None]] = []
    path = tmp_path / "rank0.flight"
    recorder = flight.install(path, hooks, "nccl")
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == str(flight.TORCH_TRACE_ENTRIES)  # torch's recorder too
    try:
        assert recorder.queued
        dist.all_reduce(torch.zeros(4))
        assert flight.read(path, 0) == FlightState(0, True, "all_reduce", 1, 16)
        works[0].done = True
        deadline = time.monotonic() + 5
        while (state := flight.read(path, 0)) is not None and state.inside and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state == FlightState(0, False, "all_reduce", 1, 0)
    finally:
        for undo in reversed(hooks):
            undo()


def test_every_rank_in_the_same_collective_names_no_culprit() -> None:
    states = {r: FlightState(r, True, "all_reduce", 3, 4) for r in range(2)}
    line = flight.diagnose(states, {})
    parts = line.split("; ")
    assert states[0].label == "all_reduce #3 (4 B)" and len(parts) == 3
    assert parts[:2] == [f"rank {r} waits in {states[r].label}" for r in range(2)]
    assert parts[2].startswith("every rank waits in the same collective")
    assert parts[2].endswith("stuck (network, NCCL/RCCL, driver)")
