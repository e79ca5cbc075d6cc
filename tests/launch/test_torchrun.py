"""Runs that share a machine: torchrun ranks, where a raising or hung rank must not stall the others,
and two sessions started together.

Two torchrun agents (one rank each) rendezvous on 127.0.0.1 with gloo, as two nodes would.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import FSDP_ONLY

# torchrun agents, in-place ranks and hangs: about 90 s on 2 cores, so the full tier (CI runs it on every submission).
pytestmark = [pytest.mark.slow, pytest.mark.full_tier]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def two_agents(tmp_path: Path, *pytest_args: str, select: str = FSDP_ONLY,
               timeout: float = 240) -> tuple[list[str], float]:
    """Run pytest under two single-rank torchrun agents; return each agent's output and the wall time."""
    port = free_port()
    (tmp_path / "refs").mkdir(exist_ok=True)  # a comparing run's folder must exist; these fail before comparing
    procs = []
    started = time.monotonic()
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--node-rank={node}", "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "-k", select,
               "--gpuregress-steps=4", f"--gpuregress-reference-dir={tmp_path / 'refs'}", *pytest_args]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    return outputs, time.monotonic() - started


def test_a_rank_that_raises_fails_its_peers_at_once_with_its_error(tmp_path: Path) -> None:
    # Two scenarios: after the first failure tore the process group down, the second fails at once, saying why.
    outputs, wall = two_agents(tmp_path, "--gpuregress-inject=crash:rank=1,step=1", "--gpuregress-timeout=300",
                               select="fsdp and not triage and not resume and not bf16 or fully_shard and not resume")
    assert "listen beyond loopback" in outputs[0]  # torchrun's store binds every interface: the header says so
    for out in outputs:  # both ranks report rank 1's error, not a transport error or a timeout
        assert "rank 1 raised RuntimeError" in out and "injected crash" in out, out[-3000:]
        assert "not run: launch 1 (" in out and "fsdp.rank:run) failed and tore" in out, out[-3000:]
        assert "2 failed" in out, out[-3000:]
    assert wall < 120, wall  # the group timeout would be 360 s


def test_a_hung_rank_ends_the_run_at_the_timeout_with_where_it_was(tmp_path: Path) -> None:
    # 30 s, not less: on a loaded CI machine the ranks' start-up alone took over 10 s, so the limit struck before
    # rank 1 reached its hang and the stack showed start-up code instead.
    outputs, wall = two_agents(tmp_path, "--gpuregress-inject=hang:rank=1,step=1", "--gpuregress-timeout=30")
    joined = "\n".join(outputs)
    assert "time limit (30s, --gpuregress-timeout)" in joined, joined[-4000:]
    assert "rank 1 still running" in joined and "outside any collective" in joined, joined[-4000:]
    assert 'faults/process.py", line' in joined, joined[-4000:]  # the hung rank's own stack
    assert wall < 30 + 90, wall


def test_two_sessions_started_together_in_one_folder_do_not_collide(tmp_path: Path) -> None:
    """Two CI jobs on one machine: no shared port, run folder or reference write between them."""
    from pytest_gpuregress.reference import store

    refs = tmp_path / "refs"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "--gpuregress-steps=4",
           f"--gpuregress-reference-dir={refs}", "-k", FSDP_ONLY]

    def both(*extra: str) -> list[str]:
        procs = [subprocess.Popen([*cmd, *extra], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for _ in range(2)]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outputs[0][-2000:] + outputs[1][-2000:]
        return outputs

    # Both recording the same reference at once (each launching its own ranks, on its own ports and run
    # folders): the store's lock serialises the writes, one wins whole, and it loads.
    both("--gpuregress-record", "--gpuregress-replicas=0")
    assert store.read_reference(store.ReferenceLocation(refs, "fsdp", "cpu-gloo-w2-fp32")).steps == 4
    assert not [p.name for p in (refs / "fsdp").iterdir() if p.name.startswith(".")]  # no leftovers


def test_nodes_that_read_different_files_are_refused_naming_what_differs(tmp_path: Path) -> None:
    # As if the second node had another model config file: its session builds another architecture digest.
    # The check runs before any training, so this costs two process starts; the group stays usable after it.
    (tmp_path / "conftest.py").write_text(
        "import os\n"
        "from pytest_gpuregress.training import models\n"
        "if os.environ.get('RANK') == '1':\n"
        "    models.NOT_ARCHITECTURE = models.NOT_ARCHITECTURE - {'use_cache'}\n")
    outputs, _ = two_agents(tmp_path, "--gpuregress-timeout=120",
                            select="fsdp and not triage and not resume and not bf16 or fully_shard and not resume")
    for out in outputs:
        assert "rank 1's node reads other files than rank 0's (config model_architecture: rank 0 '" in out, out[-3000:]
        assert "2 failed" in out and "tore the process group down" not in out, out[-3000:]
