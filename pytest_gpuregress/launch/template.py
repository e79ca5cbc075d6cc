"""Fresh ranks without fresh imports: a template process that has imported torch and the libraries forks them.

CPU only (a GPU driver touched before a fork is unusable in the child). A template serves one import-time
environment: only ``AFTER_IMPORT`` variables may differ from its ranks'. Keeps Popen's face for the pool.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO, Any

# Environment variables that change per test without changing what a rank computes (pytester gives every test its
# own HOME and temp root): a pooled rank keeps the values it started with (pool.py), a template its own.
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST", "HOME", "USERPROFILE", "PYTEST_DEBUG_TEMPROOT", "PY_COLORS"})
# Read by a rank only after the imports, so ranks may differ from their template in them.
AFTER_IMPORT = VOLATILE_ENV | {"RANK", "LOCAL_RANK", "WORLD_SIZE", "GPUREGRESS_PARENT_PID"}
# What every built-in scenario's rank imports; a user's scenario module is imported by its rank, as before.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "numpy",
           "safetensors.torch", "transformers", "accelerate", "peft", "pytest_gpuregress.launch.worker",
           "pytest_gpuregress.scenarios.fsdp.rank", "pytest_gpuregress.scenarios.lora.rank",
           "pytest_gpuregress.scenarios.checkpoint.rank")
MAX_TEMPLATES = 4  # each holds torch and the libraries (a few hundred MB); past this, ranks start as before
DISABLE = "GPUREGRESS_RANK_TEMPLATE"  # =0: every rank imports for itself (to rule the template out)
EnvKey = tuple[tuple[str, str], ...]


def template_key(env: dict[str, str]) -> EnvKey:
    return tuple(sorted((k, v) for k, v in env.items() if k not in AFTER_IMPORT))


class ForkedRank:
    """A rank forked by a template: the parts of ``subprocess.Popen`` the pool and the launcher use. Its template
    reaps it and writes its exit status to ``exit_path`` (Popen's convention: minus the signal that killed it)."""

    def __init__(self, pid: int, stdin: IO[bytes], exit_path: Path, template: Template) -> None:
        self.pid, self.stdin, self.exit_path, self.template = pid, stdin, exit_path, template
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.exit_path.exists():
                self.returncode = int(self.exit_path.read_text())
            elif not _running(self.pid) and self.template.proc.poll() is not None:  # else its status is coming
                # Gone (or a zombie nobody reaps) with its template: no status will come. Its log says why.
                self.returncode = -signal.SIGKILL
                with open(self.exit_path.with_suffix(".log"), "a") as log:
                    log.write(f"\nthe template that forked this rank exited ({self.template.proc.returncode}), and "
                              f"the rank with it; the template's log ends:\n{self.template.log_tail()}\n")
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return code


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Template:
    """The launcher's handle on one template process."""

    def __init__(self, env: dict[str, str]) -> None:
        # Its own folder: a template outlives the groups whose ranks it forks.
        self.log = Path(tempfile.mkdtemp(prefix="gpuregress-template-")) / "template.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True)
        assert self.proc.stdout is not None
        # Blocks for the imports; a template that failed them (or found threads it cannot fork past) says so.
        self.ready = self.proc.stdout.readline() == b"ready\n"

    def fork(self, rank: int, env: dict[str, str], log: Path) -> ForkedRank | None:
        """A fresh rank with ``env``, its output in ``log``; None where the template cannot fork one."""
        if not self.ready or self.proc.poll() is not None:
            return None
        jobs, exit_path = log.with_suffix(".jobs"), log.with_suffix(".exit")
        os.mkfifo(jobs)
        # Read and write: the open does not wait for the rank to open its end, and job paths wait in the pipe.
        stdin = os.fdopen(os.open(jobs, os.O_RDWR), "wb", buffering=0)
        request = {"rank": rank, "env": env, "log": str(log), "jobs": str(jobs), "exit": str(exit_path),
                   "cwd": os.getcwd()}  # where a new interpreter would start: the launcher's directory now
        try:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().decode().strip()
        except OSError:
            answer = ""
        if not answer.isdigit():
            stdin.close()
            self.ready = False
            return None
        return ForkedRank(int(answer), stdin, exit_path, self)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()  # at EOF the template leaves; ranks still running die with it (worker.py)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.log.parent, ignore_errors=True)


class Templates:
    """The process's templates, by import-time environment; started on first use, kept until the process exits."""

    def __init__(self) -> None:
        self.by_key: dict[EnvKey, Template] = {}

    def fork(self, rank: int, env: dict[str, str], log: Path) -> ForkedRank | None:
        if env.get(DISABLE, os.environ.get(DISABLE)) == "0":
            return None
        key = template_key(env)
        template = self.by_key.get(key)
        if template is None:
            if len(self.by_key) >= MAX_TEMPLATES:
                return None
            template = self.by_key[key] = Template(env)
        return template.fork(rank, env, log)

    def close(self) -> None:
        while self.by_key:
            self.by_key.popitem()[1].close()


def _single_threaded() -> bool:
    """A fork copies only the calling thread: one that holds a lock elsewhere would leave it held forever."""
    return len(os.listdir("/proc/self/task")) == 1 if os.path.isdir("/proc/self/task") else False


def _write_exit(path: str, code: int) -> None:
    partial = f"{path}.partial"
    try:
        Path(partial).write_text(f"{code}\n")
        os.replace(partial, path)
    except OSError as exc:  # the group's folder is gone: nobody waits for this rank any more
        print(f"template: could not write {path}: {exc!r}", file=sys.stderr)


def _reaper(exits: dict[int, str]) -> Any:
    """The SIGCHLD handler: reap every rank that ended and write its status. Ranks of a group end together, and
    Python runs a handler again inside itself for each signal: each call reaps whole (one waitpid takes a child
    exactly once) and writes what it took, so no status is lost, and nothing it meets may end the template."""
    def reap(*_: object) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            path = exits.pop(pid, None)
            if path is not None:
                _write_exit(path, os.waitstatus_to_exitcode(status))
    return reap


def _become_rank(request: dict[str, Any], template: int) -> None:
    """In the forked child: this request's environment and files, then the worker's serving loop; never returns.
    ``template``: the parent's pid as the template knew it before the fork, never read back here, so a template
    killed in between leaves a rank that sees its parent gone (worker.die_with_parent) instead of adopting init."""
    try:
        os.setsid()  # a session of its own, as the pool's ranks have, so its whole tree can be killed
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"], GPUREGRESS_PARENT_PID=str(template))
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        # Not blocking in the open: a launcher that already closed its end leaves no writer, and the rank reads EOF.
        jobs = os.open(request["jobs"], os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(jobs, True)
        os.dup2(jobs, 0)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the template's stdin object holds its own requests
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        from .worker import serve

        serve(int(request["rank"]))
    except BaseException:  # noqa: BLE001 - what stopped the rank before it served goes to its log (fd 2 where set)
        traceback.print_exc()
    finally:
        os._exit(1)


def main() -> None:
    # No parent-death signal here: it follows the thread that started the template, which may end long before the
    # launcher does. The template leaves at EOF on stdin, which the launcher's exit closes; its ranks die with it.
    if sys.path and sys.path[0] == os.getcwd():  # `python -m` put the start-up directory first, as in worker.py
        sys.path.pop(0)
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a rank that imports for itself will report it properly
        print(f"template: import failed: {exc!r}", file=sys.stderr)
        print("failed", flush=True)
        return
    exits: dict[int, str] = {}
    signal.signal(signal.SIGCHLD, _reaper(exits))
    print("ready" if _single_threaded() else "threads", flush=True)
    for line in sys.stdin:
        print(_fork_rank(json.loads(line), exits), flush=True)


def _fork_rank(request: dict[str, Any], exits: dict[int, str]) -> str:
    """The forked rank's pid, or why there is none. Never raises: the template's ranks die with it, so a failed fork
    (out of memory, a process limit) must leave the template serving; the launcher starts that rank itself."""
    if not _single_threaded():
        return "threads"
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # the reaper must know the pid before it ends
    template = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:
        print(f"template: fork failed: {exc!r}", file=sys.stderr, flush=True)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        return "failed"
    if pid == 0:
        _become_rank(request, template)
    exits[pid] = request["exit"]
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    return str(pid)


if __name__ == "__main__":
    main()
