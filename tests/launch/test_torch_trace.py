"""torch's own flight recorder on NCCL/RCCL: armed to dump before the launcher's limit, read without unpickling.

The dumps in tests/data/torch_fr/ are torch 2.13's own (``make_dumps.py`` there: two gloo ranks, an
all_reduce, DTensor's ``full_tensor()`` and ``clip_grad_norm_``), in the schema ProcessGroupNCCL dumps on a
watchdog timeout. The hangs are made from them by cutting a rank's ring short and setting entries' states.
"""

from __future__ import annotations

import copy
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuregress.launch import safe_pickle, torch_trace
from pytest_gpuregress.launch.job import Job
from pytest_gpuregress.launch.spawn import RankOutcome, SpawnLauncher

DATA = Path(__file__).parents[1] / "data" / "torch_fr"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No flight-recorder variable of the user's; monkeypatch puts back whatever the tests set."""
    for name in (*torch_trace.FILE_VARS, *torch_trace.BUFFER_VARS, torch_trace.DUMP_VAR, torch_trace.ARMED_VAR,
                 torch_trace.TIMING_VAR):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def recorded(rank: int) -> dict[str, Any]:
    return torch_trace.read_dump(DATA / f"torch_fr_trace_rank{rank}")


def on_nccl(dump: dict[str, Any], upto: int, last_state: str = "completed") -> dict[str, Any]:
    """The recorded dump as an NCCL rank's: entries up to collective ``upto``, all completed but the last."""
    dump = copy.deepcopy(dump)
    dump["entries"] = [e for e in dump["entries"] if e["collective_seq_id"] <= upto]
    for entry in dump["entries"]:
        entry["profiling_name"] = entry["profiling_name"].replace("gloo:", "nccl:")
        entry["state"] = "completed"
    dump["entries"][-1]["state"] = last_state
    return dump


def write(folder: Path, dumps: dict[int, dict[str, Any]]) -> str:
    prefix = str(folder / torch_trace.PREFIX)
    for rank, dump in dumps.items():
        Path(f"{prefix}{rank}").write_bytes(pickle.dumps(dump, protocol=2))  # as torch writes it: protocol 2, no globals
    return prefix


def test_torchs_own_dump_is_read_and_names_dtensor_collectives_by_their_caller() -> None:
    entries = torch_trace.entries_of(0, recorded(0))
    assert [(e.seq, e.op) for e in entries] == [(1, "gloo:all_reduce"), (2, "gloo:scatter"), (3, "gloo:all_gather"),
                                                (4, "gloo:scatter"), (5, "gloo:scatter"), (6, "gloo:all_reduce")]
    # Functional collectives bypass the plugin's wrappers; torch's recorder names them with their frames.
    assert entries[2].origin.startswith("full_tensor (distributed/tensor/_api.py:")
    assert entries[5].origin.startswith("_get_total_norm (nn/utils/clip_grad.py:")
    assert entries[0].sizes == "4x3 Float"
    as_json = torch_trace.entries_of(0, torch_trace.read_dump(DATA / "torch_fr_trace_json_rank0"))
    assert [(e.seq, e.op, e.sizes) for e in as_json] == [(e.seq, e.op, e.sizes) for e in entries]


def test_the_rank_that_never_entered_the_collective_is_the_culprit(tmp_path: Path) -> None:
    # clip_grad_norm_ over DTensors: rank 0 waits in its all-reduce, rank 1 stopped after the scatter before it.
    prefix = write(tmp_path, {0: on_nccl(recorded(0), 6, "started"), 1: on_nccl(recorded(1), 5)})
    text = torch_trace.report(prefix, 2, tmp_path, time.time() - 5)
    assert text is not None
    line = text.splitlines()[0]
    waiting = torch_trace.entries_of(0, on_nccl(recorded(0), 6, "started"))[-1]
    assert (waiting.op, waiting.seq, waiting.desc, waiting.sizes) == ("nccl:all_reduce", 6, "default_pg", "1 Float")
    assert waiting.origin.startswith("_get_total_norm (")
    heading, _, said = line.partition(": ")
    assert heading.startswith("torch's flight recorder")
    assert said.startswith(f"rank 0 waits in {waiting.label} for rank 1: rank 1 never entered it (")
    assert said.endswith("(its last: nccl:scatter #5, completed)")
    assert "1 Float, from _get_total_norm (" in said  # named with its caller
    assert text.splitlines()[-1] == f"dumps: {prefix}0, {prefix}1"


def test_a_hang_in_full_tensor_is_named_with_its_caller() -> None:
    dumps = {0: on_nccl(recorded(0), 3, "scheduled"), 1: on_nccl(recorded(1), 2)}
    line = torch_trace.diagnose(dumps)
    waiting = torch_trace.entries_of(0, dumps[0])[-1]
    assert (waiting.op, waiting.seq, waiting.sizes) == ("nccl:all_gather", 3, "2x2 Float")
    assert waiting.origin.startswith("full_tensor (")
    assert line is not None and line.startswith(f"rank 0 waits in {waiting.label} for rank 1")
    assert "2x2 Float, from full_tensor (" in line  # named with its caller


@pytest.mark.parametrize(("states", "expected"), [
    (("started", "scheduled"), "rank 0 run nccl:all_reduce #6 (group default_pg, 1 Float, from _get_total_norm"),
    (("started", "started"), "every rank is in nccl:all_reduce #6"),
    (("completed", "started"), "rank 1 did not finish nccl:all_reduce #6"),
])
def test_when_every_rank_entered_it_the_states_name_the_culprit(states: tuple[str, str], expected: str) -> None:
    dumps = {rank: on_nccl(recorded(rank), 6, state) for rank, state in enumerate(states)}
    line = torch_trace.diagnose(dumps)
    assert line is not None and line.startswith(expected), line
    if states == ("started", "scheduled"):
        assert "rank 1 queued it but never started it" in line


def test_ranks_in_different_collectives_are_named_as_diverged() -> None:
    dumps = {rank: on_nccl(recorded(rank), 6, "started") for rank in (0, 1)}
    dumps[1]["entries"][-1]["profiling_name"] = "nccl:all_gather"
    where, _, what = torch_trace.diagnose(dumps).partition(": ")
    assert where.endswith("diverged at collective #6")
    assert what.split(", ") == ["rank 0 nccl:all_reduce (1 Float)", "rank 1 nccl:all_gather (1 Float)"]


def test_nothing_unfinished_is_no_culprit_and_a_missing_dump_is_said(tmp_path: Path) -> None:
    assert torch_trace.diagnose({0: on_nccl(recorded(0), 6), 1: on_nccl(recorded(1), 6)}) is None
    line = torch_trace.diagnose({0: on_nccl(recorded(0), 6, "started")})
    assert line is not None and line.rpartition("; ")[2].startswith("no dump from rank 1 (killed")


def test_a_stale_dump_at_a_users_location_is_not_collected(tmp_path: Path) -> None:
    prefix = write(tmp_path, {0: on_nccl(recorded(0), 6, "started")})
    os.utime(f"{prefix}0", (time.time() - 3600, time.time() - 3600))
    assert torch_trace.report(prefix, 1, tmp_path, time.time()) is None


class Evil:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {MARKER}",)


MARKER = Path("/nonexistent")  # set per test


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_a_dump_that_names_python_code_is_refused_and_nothing_runs(tmp_path: Path, protocol: int) -> None:
    global MARKER
    MARKER = tmp_path / "ran"
    dump = recorded(0)
    dump["entries"][0]["frames"] = [Evil()]
    path = tmp_path / "torch_fr_trace_rank0"
    path.write_bytes(pickle.dumps(dump, protocol=protocol))
    with pytest.raises(safe_pickle.UnsafePickle, match=r"refused to read the flight-recorder dump .*(GLOBAL|REDUCE)"
                                                      r".*Nothing in it ran"):
        torch_trace.read_dump(path)
    assert not MARKER.exists()
    text = torch_trace.report(str(tmp_path / torch_trace.PREFIX), 1, tmp_path, 0)
    assert text is not None and "refused to read" in text and not MARKER.exists()


def test_the_unpickler_itself_refuses_globals_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should the opcode scan miss one, the Unpickler's find_class still refuses every global."""
    global MARKER
    MARKER = tmp_path / "ran"
    monkeypatch.setattr(safe_pickle, "_PLAIN", frozenset(op.name for op in __import__("pickletools").opcodes))
    with pytest.raises(safe_pickle.UnsafePickle, match=r"names the Python global posix\.system|nt\.system"):
        safe_pickle.loads(pickle.dumps(Evil()))
    assert not MARKER.exists()


def test_a_truncated_dump_is_unreadable_not_unsafe(tmp_path: Path) -> None:
    path = tmp_path / "dump"
    path.write_bytes((DATA / "torch_fr_trace_rank0").read_bytes()[:200])
    with pytest.raises(safe_pickle.UnreadablePickle, match="not a well-formed pickle") as info:
        torch_trace.read_dump(path)
    assert not isinstance(info.value, safe_pickle.UnsafePickle)


@pytest.mark.parametrize("backend", ["nccl", "rccl", "cpu:gloo,cuda:nccl"])
def test_on_nccl_the_watchdog_fires_before_the_launchers_limit_with_room_to_dump(backend: str) -> None:
    assert torch_trace.group_timeout(backend, 600) == 570  # torch waits up to 15 s for the dump
    assert 0 < torch_trace.group_timeout(backend, 20) < 20


def test_on_gloo_the_launchers_limit_fires_first() -> None:
    assert torch_trace.group_timeout("gloo", 600) == 660


def test_arming_sets_the_dump_switch_and_location_unless_the_user_did(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    prefix = torch_trace.arm(tmp_path / "run1", "nccl", env)
    assert prefix == str(tmp_path / "run1" / "torch_fr_trace_rank")
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == prefix
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_ENABLE_TIMING"] == "1"  # else no entry is ever "started"
    # Armed twice for one job (worker.py: before the group, and per job): nothing changes.
    assert torch_trace.arm(tmp_path / "run1", "nccl", again := dict(env)) == prefix and again == env
    # The next job (in place, the same process) dumps into its own folder.
    assert torch_trace.arm(tmp_path / "run2", "nccl", env) == str(tmp_path / "run2" / "torch_fr_trace_rank")
    mine = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_FR_BUFFER_SIZE": "64", "TORCH_NCCL_ENABLE_TIMING": "0"}
    env = dict(mine)
    assert torch_trace.arm(tmp_path, "nccl", env) == "/scratch/fr_"
    assert {k: v for k, v in env.items() if k != torch_trace.ARMED_VAR} == mine


def test_on_gloo_nothing_is_set(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    assert torch_trace.arm(tmp_path, "gloo", env) is None and env == {}


def test_the_rank_is_armed_before_its_process_group_is_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               clean_env: None) -> None:
    import torch.distributed as dist

    from pytest_gpuregress.launch import worker

    seen: dict[str, Any] = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(env=dict(os.environ), **kw))
    job = Job(scenario="x:y", config={}, world_size=2, device_kind="cpu", backend="nccl", run_dir=str(tmp_path),
              timeout_s=torch_trace.group_timeout("nccl", 600))
    worker._init_process_group(job, 0, 0)
    assert seen["env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert seen["env"]["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "torch_fr_trace_rank")
    assert seen["env"]["TORCH_NCCL_ENABLE_TIMING"] == "1"
    assert seen["timeout"].total_seconds() == 570


def test_the_launch_builds_its_job_with_the_backends_group_timeout(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pytest_gpuregress.plugin.launches import Launches
    from pytest_gpuregress.plugin.options import Options
    from pytest_gpuregress.scenarios import Launch, get_scenario
    from pytest_gpuregress.stack.platforms import Platform

    jobs: list[Job] = []

    class Capture:
        def make_run_dir(self) -> Path:
            return tmp_path

        def run(self, job: Job, wall_timeout_s: float) -> Any:
            jobs.append(job)
            raise StopIteration

    for backend, device in (("nccl", "cuda"), ("gloo", "cpu")):
        platform = Platform(device, backend, 2, "sm_90" if device == "cuda" else "cpu",
                            "cuda" if device == "cuda" else "cpu", False)
        launches = Launches(Options(timeout=300), platform, SimpleNamespace(), SimpleNamespace(), tmp_path)  # type: ignore[arg-type]
        launches._launcher = Capture()
        with pytest.raises(StopIteration):
            launches.launch(get_scenario("fsdp"), Launch(key="k", config={}, inject=False), [])
    assert [j.timeout_s for j in jobs] == [270, 360]


def test_a_failed_nccl_launch_reports_the_dumps_in_its_run_folder(tmp_path: Path, clean_env: None) -> None:
    write(tmp_path, {0: on_nccl(recorded(0), 6, "started"), 1: on_nccl(recorded(1), 5)})
    job = Job(scenario="pytest_gpuregress.scenarios.fsdp.rank:run", config={}, world_size=2, device_kind="cuda",
              backend="nccl", run_dir=str(tmp_path), timeout_s=570)
    died = [RankOutcome(rank=r, status="died", returncode=-6, last_progress="step 3 done") for r in (0, 1)]
    message = SpawnLauncher(reuse=False)._failure_message(job, died, died, 600, time.time() - 5)
    assert "flight recorder (" in message and "rank 0 waits in nccl:all_reduce #6" in message
    gloo = Job(**{**job.__dict__, "backend": "gloo"})
    assert "flight recorder" not in SpawnLauncher(reuse=False)._failure_message(gloo, died, died, 600, time.time() - 5)


def wait_for(path: Path, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.02)
    return path.exists()


def test_a_rank_dumps_on_the_launchers_request_and_only_then(tmp_path: Path) -> None:
    target = tmp_path / "torch_fr_trace_rank1"
    responder = torch_trace.DumpResponder(tmp_path, target, poll_s=0.02, dump=lambda: b'{"entries": []}')
    try:
        time.sleep(0.1)
        assert not target.exists()
        (tmp_path / torch_trace.REQUEST).write_text("now\n")
        assert wait_for(target)
        assert target.read_bytes() == b'{"entries": []}'
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # written aside, then renamed
    finally:
        responder.close()
    assert not responder._thread.is_alive()


def test_a_failed_dump_is_said_in_the_rank_log_and_writes_nothing(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    def broken() -> bytes:
        raise RuntimeError("no recorder")

    responder = torch_trace.DumpResponder(tmp_path, tmp_path / "dump0", poll_s=0.02, dump=broken)
    responder.close()
    assert responder.answer() is False and not (tmp_path / "dump0").exists()
    assert "no recorder" in capsys.readouterr().err


def test_the_dump_thread_runs_per_job_on_nccl_only_and_stops_with_the_job(tmp_path: Path) -> None:
    hooks: list[Any] = []
    assert torch_trace.serve_requests(tmp_path, 0, "gloo", hooks, {}) is None and hooks == []
    for job in ("job1", "job2"):  # a pooled rank serves one job after another, each in its own folder
        env: dict[str, str] = {}
        torch_trace.arm(tmp_path / job, "nccl", env)
        responder = torch_trace.serve_requests(tmp_path / job, 3, "nccl", hooks, env)
        assert responder is not None
        assert responder.request == tmp_path / job / torch_trace.REQUEST
        assert responder.path == tmp_path / job / "torch_fr_trace_rank3"
        for hook in hooks:
            hook()
        hooks.clear()
        assert not responder._thread.is_alive()


def test_torchs_recorder_is_dumped_as_json_on_request_from_a_real_gloo_group(tmp_path: Path) -> None:
    """gloo records into the same flight recorder as NCCL; the requested dump is the JSON the report reads."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(4, 3))
        target = Path(f"{tmp_path / torch_trace.PREFIX}0")
        responder = torch_trace.DumpResponder(tmp_path, target, poll_s=0.02)
        (tmp_path / torch_trace.REQUEST).write_text("now\n")
        assert wait_for(target)
        responder.close()
    finally:
        dist.destroy_process_group()
    assert target.read_bytes().lstrip()[:1] == b"{"
    entries = torch_trace.entries_of(0, torch_trace.read_dump(target))
    assert ("gloo:all_reduce", "4x3 Float") in [(e.op, e.sizes) for e in entries]


FAKE_RANK = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a rank blocked in C++ does not die of the stack request either
from pytest_gpuregress.launch.torch_trace import DumpResponder
run_dir, rank, dump = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]).read_bytes()
DumpResponder(run_dir, run_dir / f"torch_fr_trace_rank{rank}", poll_s=0.05, dump=lambda: dump)
Path(sys.argv[3] + ".ready").touch()
time.sleep(120)  # hung
"""


class HungGroup:
    """Two ranks that hang and answer the launcher's dump request with a recorded dump (no torch to import)."""

    def __init__(self, run_dir: Path, dumps: dict[int, dict[str, Any]]) -> None:
        import json
        import subprocess
        import sys

        self.procs = []
        for rank, dump in dumps.items():
            data = run_dir.parent / f"recorded{rank}.json"
            data.write_text(json.dumps(dump))
            self.procs.append(subprocess.Popen([sys.executable, "-c", FAKE_RANK, str(run_dir), str(rank), str(data)]))
        for rank in dumps:  # started up before the launch's clock starts, as a pooled rank is
            assert wait_for(run_dir.parent / f"recorded{rank}.json.ready", 60)

    def submit(self, job_path: Path) -> None:
        pass

    def startup_log(self, rank: int) -> Path:
        return Path("/nonexistent")

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()

    close = kill


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_at_its_limit_the_launcher_asks_nccl_ranks_for_their_dumps_and_names_the_culprit(
        tmp_path: Path, clean_env: None, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpuregress.errors import RankFailure

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # The launch hangs long after start-up: the watchdog's timeout, counted from the collective, is still far off.
    group = HungGroup(run_dir, {0: on_nccl(recorded(0), 6, "started"), 1: on_nccl(recorded(1), 5)})
    launcher = SpawnLauncher(reuse=False, keep_dirs=True)
    monkeypatch.setattr(launcher, "_group_for", lambda job: group)
    job = Job(scenario="x:y", config={}, world_size=2, device_kind="cuda", backend=backend, run_dir=str(run_dir),
              timeout_s=570)
    try:
        with pytest.raises(RankFailure, match="rank 0 hung, rank 1 hung") as failure:
            launcher.run(job, 1.0)
    finally:
        group.kill()
    message = str(failure.value)
    if backend == "gloo":  # the launcher names hung gloo ranks with their stacks; nothing is asked of them
        assert not (run_dir / torch_trace.REQUEST).exists() and "flight recorder (" not in message
        return
    assert (run_dir / torch_trace.REQUEST).exists()
    assert "flight recorder (" in message and "rank 0 waits in nccl:all_reduce #6 (" in message
    assert "#6 (group default_pg, 1 Float, from _get_total_norm" in message
    assert f"dumps: {run_dir}/torch_fr_trace_rank0, {run_dir}/torch_fr_trace_rank1" in message


class _Recorders:
    """torch._C._distributed_c10d as a CUDA build has it: both recorders' JSON dumps, each call counted."""

    def __init__(self, *names: str) -> None:
        self.calls: list[str] = []
        for name in names:
            setattr(self, name, self._dump(name))

    def _dump(self, name: str) -> Any:
        def dump(include_collectives: bool, only_active: bool) -> bytes:
            self.calls.append(name)
            return f'{{"from": "{name}"}}'.encode()

        return dump


@pytest.mark.parametrize(("backend", "asked"), [("nccl", "_dump_nccl_trace_json"), ("gloo", "_dump_fr_trace_json")])
def test_each_backend_asks_for_its_own_recorder(backend: str, asked: str) -> None:
    """NCCL's collectives are in NCCL's own recorder ("FlightRecorder NCCL"); the CPU recorder holds gloo's."""
    c10d = _Recorders("_dump_nccl_trace_json", "_dump_fr_trace_json")
    assert torch_trace.dump_json(backend, c10d) == f'{{"from": "{asked}"}}'.encode()
    assert c10d.calls == [asked]
    # A build without NCCL's recorder falls back to the CPU one; gloo never reads NCCL's.
    assert torch_trace.dump_json("nccl", _Recorders("_dump_fr_trace_json")) == b'{"from": "_dump_fr_trace_json"}'
    with pytest.raises(RuntimeError, match="_dump_fr_trace_json"):
        torch_trace.dump_json("gloo", _Recorders("_dump_nccl_trace_json"))


def test_the_requested_dump_of_an_nccl_rank_comes_from_nccls_recorder(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    c10d = _Recorders("_dump_nccl_trace_json", "_dump_fr_trace_json")
    import torch

    monkeypatch.setattr(torch._C, "_distributed_c10d", c10d)
    env: dict[str, str] = {}
    torch_trace.arm(tmp_path, "nccl", env)
    hooks: list[Any] = []
    responder = torch_trace.serve_requests(tmp_path, 0, "nccl", hooks, env)
    assert responder is not None and responder.answer()
    for hook in hooks:
        hook()
    assert responder.path.read_bytes() == b'{"from": "_dump_nccl_trace_json"}' and c10d.calls == ["_dump_nccl_trace_json"]


def nccl_json_dump(rank: int, entries: list[tuple[int, str, str]]) -> bytes:
    """A rank's dump in the JSON torch's ``_dump_nccl_trace_json`` writes (FlightRecorder's dump_json, version 2.10:
    the keys a gloo rank's ``_dump_fr_trace_json`` gives, with NCCL's profiling names and communicator state)."""
    import json

    return json.dumps({
        "version": "2.10", "comm_lib_version": "2.27.5",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {"0": {"last_enqueued_collective": str(entries[-1][0]), "last_started_collective": "-1",
                            "last_completed_collective": "-1"}},
        "nccl_comm_state": {},
        "entries": [{"record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
                     "p2p_seq_id": 0, "op_id": seq, "profiling_name": op, "time_created_ns": 1_000 + seq,
                     "input_sizes": [[1024]], "input_dtypes": ["BFloat16"], "output_sizes": [[1024]],
                     "output_dtypes": ["BFloat16"], "state": state, "time_discovered_started_ns": 0,
                     "time_discovered_completed_ns": 0, "retired": state == "completed", "timeout_ms": 600000,
                     "is_p2p": False, "thread_id": "1", "thread_name": "python"}
                    for i, (seq, op, state) in enumerate(entries)],
    }, separators=(",", ":")).encode()


def test_nccls_json_dump_is_read_and_names_the_rank_that_never_entered(tmp_path: Path) -> None:
    prefix = tmp_path / torch_trace.PREFIX
    Path(f"{prefix}0").write_bytes(nccl_json_dump(0, [(1, "nccl:_reduce_scatter_base", "completed"),
                                                      (2, "nccl:all_reduce", "started")]))
    Path(f"{prefix}1").write_bytes(nccl_json_dump(1, [(1, "nccl:_reduce_scatter_base", "completed")]))
    dumps = {r: torch_trace.read_dump(Path(f"{prefix}{r}")) for r in (0, 1)}
    assert [(e.op, e.state, e.sizes) for e in torch_trace.entries_of(0, dumps[0])] == [
        ("nccl:_reduce_scatter_base", "completed", "1024 BFloat16"), ("nccl:all_reduce", "started", "1024 BFloat16")]
    line = torch_trace.diagnose(dumps)
    waiting = torch_trace.entries_of(0, dumps[0])[-1]
    assert (waiting.desc, waiting.origin) == ("default_pg", "")
    assert line is not None and line.startswith(f"rank 0 waits in {waiting.label} for rank 1: rank 1 never entered"), line
