"""The consensus scenario end to end: CPU processes emulate devices (and torchrun agents nodes).

All full tier: a session of 4 rank processes costs about 20 s of CPU (13 s wall on 2 idle cores, 33 s on
loaded ones); the fast tier runs the same rank code in-process (tests/scenarios/consensus/test_consensus.py). One pytest session
of 4 ranks is shared by the first three tests. Its built-in cases run clean (4 devices
agree; every link delivers); in the same session and the same pool of ranks a test file runs the workload with a
one-ulp matmul fault in rank 2, and the link sweep with rank 1's data to rank 0 corrupted, and writes what the
scenario finds. Full tier: two torchrun agents on 127.0.0.1 as two nodes, the fault in one device of node 1.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.full_tier]
WORLD = "--gpuregress-world-size=4"

FAULTY_RUNS = '''
import json
from pathlib import Path

from pytest_gpuregress.scenarios.consensus import report, vote_of
from pytest_gpuregress.scenarios.shared import links
from pytest_gpuregress.triage.naming import described


def test_one_ulp_in_one_processs_matmul(gpuregress):
    record = gpuregress.run("consensus", faults=["matmul_ulp:rank=2"])
    vote = vote_of(record)
    Path("faulty_devices.json").write_text(json.dumps({"failures": [described(f) for f in report.failures(vote)],
                                                       "table": report.table(vote)}))


def test_one_corrupted_peer(gpuregress):
    # rank 0's chunk 1 of every all-gather and all-to-all keeps the previous call's data: what rank 1 sent it
    fault = "collective:op=all_gather|all_to_all,mode=stale_chunk,chunk=1,pieces=4,ranks=0"
    record = gpuregress.run("collectives", config={"link_sweep": True, "repeats": 3}, faults=[fault])
    found = links.findings(record.results["cases"], record.results["identities"], record.world_size, "gloo")
    Path("faulty_links.json").write_text(json.dumps([described(f) for f in found]))
'''


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One session: the built-in consensus cases clean, then the faulty runs of the test file above."""
    root = tmp_path_factory.mktemp("consensus")
    (root / "test_faulty_runs.py").write_text(FAULTY_RUNS)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "--gpuregress-consensus", WORLD,
           "-k", "consensus or faulty", "-rfs", "--junitxml=junit.xml", "test_faulty_runs.py", "gpuregress"]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return root, done.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Under torchrun every rank is a pytest session: one JUnit file each, or the ranks of a node would write one file.
JUNIT_PER_RANK = """
import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if config.option.xmlpath:
        config.option.xmlpath = config.option.xmlpath.replace(".xml", f"-rank{os.environ.get('RANK', '0')}.xml")
"""


def junit_properties(path: Path, test: str) -> dict[str, str]:
    case = next(c for c in ET.parse(path).getroot().iter("testcase") if c.get("name") == test)
    assert case.get("classname") == "gpuregress"
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def test_four_emulated_devices_agree_on_a_clean_run(four_devices: tuple[Path, str]) -> None:
    root, out = four_devices
    assert re.search(r"consensus over 4 devices in 1 group\(s\): 4 agree, 0 dissent; \d+ tensors a device", out), out
    rows = [line for line in out.splitlines() if re.match(r"  local \d \(cpu process, rank \d\)", line)]
    assert len(rows) == 4 and all(" agrees " in row and row.rstrip().endswith("-") for row in rows), rows
    props = junit_properties(root / "junit.xml", "consensus-devices")
    assert props["consensus_verdict"] == "agree" and props["consensus_devices"] == "4"
    assert props["consensus_table"].count("| agrees |") == 4


def test_one_ulp_in_one_processs_matmul_names_that_device_and_its_first_step(four_devices: tuple[Path, str]) -> None:
    root, _ = four_devices
    found = json.loads((root / "faulty_devices.json").read_text())
    [message] = found["failures"]
    assert message.startswith("[device] local 2 (cpu process, rank 2)") and " on node 0 (" in message, message
    assert "3 of 4 hold the consensus" in message, message
    assert re.search(r"differs first at training step 0, \S+ [\w.]+ \(float32\[[\d, ]*\]\): ", message), message
    assert "What to do: drain node 0" in message
    assert sum(" DISSENTS " in row for row in found["table"]) == 1


def test_every_link_delivers_and_one_corrupted_peer_names_its_link(four_devices: tuple[Path, str]) -> None:
    root, out = four_devices
    pairs = re.search(r"links: all (\d+) sender -> receiver pairs of (\d+) ranks delivered every element bit for bit", out)
    assert pairs is not None and pairs.groups() == ("12", "4"), out
    assert junit_properties(root / "junit.xml", "consensus-links")["wrong_elements"] == "0"
    [message] = json.loads((root / "faulty_links.json").read_text())
    assert message.startswith("[collective] link rank 1 (node 0 ("), message
    assert "-> rank 0 (node 0 (" in message and "(gloo over loopback)" in message and "delivers wrong data" in message
    assert "every other pair of the 4 ranks" in message and "is clean" in message


def test_under_two_torchrun_agents_the_faulty_node_is_named(tmp_path: Path) -> None:
    """Two agents of two ranks each on 127.0.0.1 stand for two nodes; device 1 of node 1 (rank 3) is one ulp off."""
    port = free_port()
    (tmp_path / "conftest.py").write_text(JUNIT_PER_RANK)
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
               "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "pytest",
               "-p", "no:cacheprovider", "--gpuregress", "--gpuregress-consensus", "-k", "consensus-devices",
               "--gpuregress-inject=matmul_ulp:rank=3", f"--junitxml={tmp_path}/junit.xml"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for out in outputs:  # every rank reaches the same verdict; each agent prints its first rank's
        assert "[device] local 1 (cpu process, rank 3) on node 1 (" in out, out[-4000:]
        assert "3 of 4 hold the consensus" in out, out[-4000:]
        assert "What to do: drain node 1 (" in out, out[-4000:]
        assert re.search(r"node 1 \([^)]*\): 1 of 2 devices dissent", out), out[-4000:]
    props = junit_properties(tmp_path / "junit-rank2.xml", "consensus-devices")  # node 1's first rank
    assert props["consensus_verdict"] == "dissent" and "rank 3) on node 1 (" in props["consensus_dissenters"]
