"""The consensus vote across devices (scenarios/consensus), device identities from nvidia-smi/amd-smi output
(stack/device_identity.py), the per-link naming of the collective sweep (scenarios/shared/links.py) and the
one-ulp matmul fault (faults/matmul.py). Synthetic devices and recorded tool output: no launch, a few ms each."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pytest_gpuregress.findings import CheckFinding
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.consensus import SCENARIO, merge_devices, report, vote_of
from pytest_gpuregress.scenarios.consensus.digest import Digests, entry_name, names_digest
from pytest_gpuregress.scenarios.consensus.group_key import group_key, key_diff
from pytest_gpuregress.scenarios.consensus.vote import (
    AGREES,
    ALONE,
    DISSENTS,
    NO_MAJORITY,
    Device,
    Difference,
    first_difference,
    vote,
)
from pytest_gpuregress.scenarios.shared import links
from pytest_gpuregress.stack import device_identity as identity
from pytest_gpuregress.triage.naming import described

NAMES = [entry_name("train", "loss", 0), entry_name("train", "grad 0.weight", 0), entry_name("train", "loss", 1),
         entry_name("train", "grad 0.weight", 1), entry_name("gemm", "matmul float32 127x253x61")]
KINDS = ["float32[]", "float32[64, 32]", "float32[]", "float32[64, 32]", "float32[127, 61]"]
H100 = {"device.kind": "cuda", "device.name": "NVIDIA H100 80GB HBM3", "device.arch": "sm_90", "device.cuda": "12.8",
        "device.driver": "570.124.06", "versions.torch": "2.13.0"}
CLEAN = (["a0", "b0", "a1", "b1", "c0"], [2.5, 10.0, 2.25, 9.0, 100.0])


def printed(check: Callable[..., list[CheckFinding]], *args: Any) -> list[str]:
    """A check's findings as the report prints them: named by triage (triage/naming.py)."""
    return [described(found) for found in check(*args)]


def gpu(rank: int, node: int = 0, local: int | None = None, hashes: list[str] | None = None,
        sums: list[float] | None = None, key: dict | None = None) -> Device:
    local = rank if local is None else local
    who = {"rank": rank, "host": f"gpu-node-{node:02d}", "node_rank": node, "local_rank": local,
           "device": f"cuda:{local}", "model": "NVIDIA H100 80GB HBM3", "bus_id": f"0000:{0x18 + local:02x}:00.0",
           "uuid": f"GPU-{rank:08d}-aaaa-bbbb-cccc-dddddddddddd", "serial": None, "smi_index": local}
    hashes, sums = hashes or CLEAN[0], sums or CLEAN[1]
    return Device(rank, who, dict(key or H100), names_digest(NAMES), tuple(hashes), tuple(sums),
                  tuple(abs(s) * 4 for s in sums))


def against_consensus(result: Any, device: Device) -> Difference | None:
    """Where ``device`` first differs from the result it is measured against (the consensus, or the largest)."""
    group = next(g for g in result.groups if any(d is device for d in g.devices))
    other = group.compared_with(device)
    return None if other is None else first_difference(device, other)


def one_ulp_up(value: float) -> float:
    return float(np.nextafter(np.float32(value), np.float32(np.inf)))


def test_devices_with_equal_digests_agree_and_nothing_fails() -> None:
    result = vote([gpu(r) for r in range(4)], NAMES, KINDS)
    assert result.outcome == AGREES and len(result.groups) == 1
    assert printed(report.failures, result) == []
    assert [row[2] for row in report.rows(result)] == [AGREES] * 4
    assert report.properties(result)["consensus_verdict"] == "agree"


def test_a_dissenting_gpu_is_named_with_node_index_bus_uuid_and_its_first_differing_step_and_tensor() -> None:
    # GPU 5 of node 12 differs from step 1 on: its loss one float32 ulp up, then its gradient.
    bad = gpu(13, node=12, local=5, hashes=["a0", "b0", "a1x", "b1x", "c0"],
              sums=[2.5, 10.0, one_ulp_up(2.25), 9.5, 100.0])
    result = vote([*(gpu(r, node=r // 8, local=r % 8) for r in range(13)), bad], NAMES, KINDS)
    assert result.outcome == DISSENTS
    group = result.groups[0]
    assert group.dissenters == [bad] and group.outcome_of(bad) == DISSENTS
    assert len(group.majority or []) == 13
    # First at digest 2 (step 1's loss), one float32 ulp up; 2 of the 5 digests differ.
    assert against_consensus(result, bad) == Difference(2, one_ulp_up(2.25), 2.25, 9.0, 2, 5)
    assert result.names[2] == entry_name("train", "loss", 1) and result.kinds[2] == "float32[]"
    [finding] = report.failures(result)
    assert finding.check == "consensus"
    message = described(finding)
    who, _, said = message.partition(" disagrees with the other 13 devices of its model and stack ")
    assert who.startswith("[device] local 5 (cuda:5, ") and who.endswith(" on node 12 (gpu-node-12)"), message
    assert all(part in who for part in ("smi GPU 5", "bus 0000:1d:00.0", f"uuid {bad.identity['uuid']}"))
    assert all(part in said for part in ("(NVIDIA H100 80GB HBM3 (sm_90), ", "CUDA 12.8", "driver 570.124.06",
                                         "torch 2.13.0", "13 of 14 hold the consensus")), message
    assert "at training step 1, loss (float32[]): " in said and "2.25000024 vs 2.25 (+1 ulp float32)" in said
    assert "2 of 5 tensors differ" in said
    assert "drain node 12 (gpu-node-12)" in message and "dcgmi diag -r 3" in message
    row = next(r for r in report.rows(result) if r[2] == DISSENTS)
    assert row[1] == "node 12 (gpu-node-12)" and row[3].startswith("training step 1, loss")
    assert report.by_node(result) == [f"  {row[1]}: 1 of 1 devices dissent"]
    props = report.properties(result)
    assert props["consensus_verdict"] == "dissent" and props["consensus_devices"] == 14
    assert props["consensus_dissenters"] == [report.where(bad)]


def test_a_tensor_that_differs_says_by_how_much_relative_to_its_magnitude() -> None:
    odd = gpu(2, hashes=["a0", "b0x", "a1", "b1", "c0"], sums=[2.5, 10.001, 2.25, 9.0, 100.0])
    result = vote([gpu(0), gpu(1), odd], NAMES, KINDS)
    difference = against_consensus(result, odd)
    assert difference == Difference(1, 10.001, 10.0, 40.0, 1, 5)
    assert abs(difference.relative - 2.5e-05) < 1e-12  # |10.001 - 10| / 40 (the sum of |x|), not / 10
    [message] = printed(report.failures, result)
    assert "training step 0, " in message and "grad 0.weight (float32[64, 32])" in message
    assert "sum 10.001 vs 10 " in message and "(2.5e-05 of its magnitude)" in message


def test_two_devices_that_differ_have_no_majority_and_both_results_are_shown() -> None:
    first, second = gpu(0), gpu(1, hashes=["a0", "b0", "a1", "b1", "c0x"], sums=[*CLEAN[1][:4], 100.5])
    result = vote([first, second], NAMES, KINDS)
    assert result.outcome == NO_MAJORITY and result.groups[0].majority is None
    assert [[d.rank for d in devices] for devices in result.groups[0].results] == [[0], [1]]
    assert first_difference(second, first) == Difference(4, 100.5, 100.0, 400.0, 1, 5)  # the GEMM battery's matmul
    assert result.names[4] == entry_name("gemm", "matmul float32 127x253x61")
    [message] = printed(report.failures, result)
    assert message.startswith("[device] no majority ") and "the 2 devices of NVIDIA H100" in message
    assert "result 1 (1 device): local 0 (cuda:0" in message and "result 2 (1 device): local 1 (cuda:1" in message
    assert "first at GEMM/reduction battery, " in message and "matmul float32 127x253x61" in message
    assert "run on more devices" in message
    assert [r[2] for r in report.rows(result)] == [NO_MAJORITY, NO_MAJORITY]


def test_an_even_split_along_two_nodes_says_the_split_follows_the_nodes() -> None:
    node0 = [gpu(r, node=0, local=r) for r in range(2)]
    node1 = [gpu(2 + r, node=1, local=r, hashes=["a0x", *CLEAN[0][1:]]) for r in range(2)]
    [message] = printed(report.failures, vote([*node0, *node1], NAMES, KINDS))
    assert message.startswith("[device] no majority ") and "the 4 devices" in message
    assert "result 2 (2 devices)" in message
    assert report._split_by_node(vote([*node0, *node1], NAMES, KINDS).groups[0])
    assert "the split follows the nodes" in message
    across = [node0[0], gpu(1, node=0, local=1, hashes=node1[0].hashes), node1[0], gpu(3, node=1, local=1)]
    [mixed] = printed(report.failures, vote(across, NAMES, KINDS))  # 2 against 2, each result on both nodes
    assert mixed.startswith("[device] no majority") and "split follows" not in mixed


def test_devices_of_another_stack_are_listed_apart_never_outvoted_and_the_split_is_a_warning() -> None:
    # Three devices on the new driver, one node that missed the upgrade: its other results are its own.
    old = {**H100, "device.driver": "550.54.15"}
    missed = gpu(3, node=1, local=0, key=old, hashes=["z"] * 5)
    result = vote([gpu(0), gpu(1), gpu(2), missed], NAMES, KINDS)
    assert [len(g.devices) for g in result.groups] == [3, 1]
    assert result.groups[1].outcome_of(missed) == "alone" and printed(report.failures, result) == []
    assert key_diff(result.groups[0].key, result.groups[1].key) == [("device.driver", "570.124.06", "550.54.15")]
    [split] = report.stack_splits(result)
    assert split.startswith("1 device(s) of NVIDIA H100 ") and " on node 1 (gpu-node-01) " in split, split
    assert "the other 3 of that model" in split and "device.driver: 570.124.06 -> 550.54.15" in split
    heading = next(line for line in report.table(result) if line.startswith("group 2 "))
    assert heading.startswith(f"group 2 (1 devices, {ALONE}; ") and "never outvoted" in heading
    # Another model is apart too, and no stack split: a mixed fleet is no finding.
    a100 = gpu(4, key={**H100, "device.name": "NVIDIA A100-SXM4-80GB", "device.arch": "sm_80"}, hashes=["y"] * 5)
    assert report.stack_splits(vote([gpu(0), gpu(1), a100], NAMES, KINDS)) == []


def test_a_dissenter_with_odd_firmware_says_so() -> None:
    devices = [Device(r, gpu(r).identity, dict(H100), names_digest(NAMES), tuple(CLEAN[0]), tuple(CLEAN[1]),
                      tuple(CLEAN[1]), "vbios 96.00.74.00.01") for r in range(3)]
    odd = Device(3, gpu(3).identity, dict(H100), names_digest(NAMES), ("a0x", *CLEAN[0][1:]), tuple(CLEAN[1]),
                 tuple(CLEAN[1]), "vbios 96.00.61.00.01")
    result = vote([*devices, odd], NAMES, KINDS)
    assert against_consensus(result, odd) == Difference(0, 2.5, 2.5, 2.5, 1, 5)  # other bits, the same sum
    [message] = printed(report.failures, result)
    assert "Its firmware (vbios 96.00.61.00.01)" in message
    assert "consensus devices' (vbios 96.00.74.00.01)." in message
    assert "training step 0, loss (float32[])" in message and "other bits, equal float64 sums" in message
    assert "1 of 5 tensors differ" in message


def test_a_device_that_ran_another_workload_is_told_apart() -> None:
    other = Device(2, gpu(2).identity, dict(H100), "another-list", ("x",), (1.0,), (1.0,))
    difference = first_difference(other, gpu(0))
    assert difference is not None and difference.index is None
    [message] = printed(report.failures, vote([gpu(0), gpu(1), other], NAMES, KINDS))
    assert "another workload: " in message and "its list of tensors differs" in message


def test_a_whole_node_that_dissents_is_suspected_as_a_node() -> None:
    devices = [gpu(r, node=r // 2, local=r % 2) for r in range(4)]
    devices += [gpu(4 + r, node=2, local=r, hashes=["a0", "b0x", "a1", "b1", "c0"]) for r in range(2)]
    result = vote(devices, NAMES, KINDS)
    assert report.whole_nodes(result.groups[0]) == {(2, "gpu-node-02")}
    messages = printed(report.failures, result)
    assert len(messages) == 2 and all("every device of node 2 (gpu-node-02)" in m for m in messages)
    assert all("dissents: suspect the node" in m for m in messages)


def test_the_group_key_is_the_device_model_and_stack_without_collectives() -> None:
    fingerprint = {"device": {"kind": "cuda", "name": "GPU 0's name", "arch": "sm_90", "driver": "570", "count": 8,
                              "firmware": "vbios 96.00"},
                   "versions": {"torch": "2.13.0", "transformers": "5.24.0"},
                   "numerics": {"tf32_matmul": False, "num_threads": 1},
                   "comm": {"backend": "nccl", "world_size": 8, "env": {"NCCL_PROTO": "LL", "MKL_CBWR": "AVX2"}}}
    key = group_key(fingerprint, "NVIDIA H100 80GB HBM3", "sm_90")
    assert key["device.name"] == "NVIDIA H100 80GB HBM3" and key["env.MKL_CBWR"] == "AVX2"
    assert not any(k.startswith(("comm.", "env.NCCL")) or k in ("device.count", "device.firmware") for k in key)
    assert key_diff(key, {**key, "versions.torch": "2.14.0"}) == [("versions.torch", "2.13.0", "2.14.0")]


def rank_record(rank: int, digests: Digests, who: dict) -> RunRecord:
    own = {"identity": who, "key": dict(H100), "names_sha": names_digest(digests.names), "seconds": 0.1}
    if rank == 0:
        own.update(names=digests.names, kinds=digests.kinds)
    return RunRecord("consensus", {}, "", 3, arrays=digests.arrays(), results={"consensus": own})


def test_merged_records_carry_every_devices_digests_and_vote_from_them() -> None:
    records = []
    for rank in range(3):
        digests = Digests()
        digests.add("train", "loss", torch.tensor(2.5 + (rank == 2) * 1e-6), 0)
        digests.add("cast", "grid to bfloat16", torch.arange(4.0).to(torch.bfloat16))
        records.append(rank_record(rank, digests, gpu(rank).identity))
    merged = merge_devices(records)
    assert merged.arrays == {} and len(merged.results["consensus"]["devices"]) == 3
    result = vote_of(merged)
    assert [d.rank for d in result.groups[0].dissenters] == [2]
    assert result.names == ["train|0|loss", "cast||grid to bfloat16"] and result.kinds[1] == "bfloat16[4]"
    lines = SCENARIO.summary({"devices": merged}, None)  # type: ignore[arg-type]
    figures = re.match(r"consensus over (\d+) devices in (\d+) group\(s\): (\d+) agree, (\d+) dissent; "
                       r"(\d+) tensors a device, ", lines[0])
    assert figures is not None and figures.groups() == ("3", "1", "2", "1", "2"), lines[0]
    assert any("DISSENTS" in line and "training step 0, loss" in line for line in lines)


def test_digests_are_bitwise_and_summed_on_the_host() -> None:
    digests = Digests()
    value = torch.tensor([1.0, -2.0, 3.0])
    digests.add("gemm", "x", value)
    digests.add("gemm", "x again", value.clone())
    digests.add("gemm", "-0 for 0", torch.tensor([1.0, -2.0, 3.0]) * torch.tensor([1.0, 1.0, 1.0]))
    digests.add("gemm", "negative zero", torch.tensor([-0.0]))
    digests.add("gemm", "zero", torch.tensor([0.0]))
    assert digests.hashes[0] == digests.hashes[1] == digests.hashes[2]
    assert digests.hashes[3] != digests.hashes[4] and digests.sums[3] == digests.sums[4]  # bits, not values
    assert (digests.sums[0], digests.magnitudes[0]) == (2.0, 6.0)
    arrays = digests.arrays()
    assert arrays["consensus/hash"].dtype == np.uint64 and arrays["consensus/stats"].shape == (5, 2)


# ---- device identity from the vendors' tools ----------------------------------------------------

NVIDIA_IDS = """0, 00000000:18:00.0, GPU-5e2b1a8c-1111-2222-3333-444455556666, 1652823045678, NVIDIA H100 80GB HBM3, 96.00.74.00.01
1, 00000000:2A:00.0, GPU-7f00aa00-1111-2222-3333-444455556666, [N/A], NVIDIA H100 80GB HBM3, 96.00.61.00.01
"""
NVIDIA_TOPOLOGY = (
    "\x1b[4m\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\tSYS\tPXB\t0-47\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tPIX\tPXB\t0-47\t0\t\tN/A\n"
    "GPU2\tSYS\tPIX\t X \tSYS\t48-95\t1\t\tN/A\n"
    "NIC0\tPXB\tPXB\tSYS\t X \n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
)
AMD_LIST_JSON = """[
    {"gpu": 0, "bdf": "0000:0c:00.0", "uuid": "28ff74a1-0000-1000-803c-3b7a6ea8fd0d", "kfd_id": 45412, "node_id": 2},
    {"gpu": 1, "bdf": "0000:22:00.0", "uuid": "2aff74a1-0000-1000-80f3-16a0e5d1ea48", "kfd_id": 59265, "node_id": 3}
]"""
AMD_LIST_TEXT = """GPU: 0
    BDF: 0000:0c:00.0
    UUID: 28ff74a1-0000-1000-803c-3b7a6ea8fd0d
    KFD_ID: 45412

GPU: 1
    BDF: 0000:22:00.0
    UUID: 2aff74a1-0000-1000-80f3-16a0e5d1ea48
"""
AMD_STATIC_ASIC = """[{"gpu": 0, "asic": {"market_name": "AMD Instinct MI300X", "asic_serial": "0x9D4C2F1A0B3E5D71"}},
 {"gpu": 1, "asic": {"market_name": "AMD Instinct MI300X", "asic_serial": "N/A"}}]"""


def test_nvidia_smi_ids_parse_into_bus_uuid_and_serial() -> None:
    first, second = identity.parse_nvidia_ids(NVIDIA_IDS)
    assert first == identity.SmiDevice(0, "0000:18:00.0", "GPU-5e2b1a8c-1111-2222-3333-444455556666",
                                       "1652823045678", "NVIDIA H100 80GB HBM3", "vbios 96.00.74.00.01")
    assert second.bus_id == "0000:2a:00.0" and second.serial is None and second.firmware == "vbios 96.00.61.00.01"


def test_amd_smi_list_parses_from_json_and_text_and_serials_from_static() -> None:
    expected = [identity.SmiDevice(0, "0000:0c:00.0", "28ff74a1-0000-1000-803c-3b7a6ea8fd0d"),
                identity.SmiDevice(1, "0000:22:00.0", "2aff74a1-0000-1000-80f3-16a0e5d1ea48")]
    assert identity.parse_amd_list(AMD_LIST_JSON) == expected
    assert identity.parse_amd_list("WARNING: a banner line\n" + AMD_LIST_JSON) == expected
    assert identity.parse_amd_list(AMD_LIST_TEXT) == expected
    assert identity.parse_amd_serials(AMD_STATIC_ASIC) == {0: "0x9D4C2F1A0B3E5D71"}


def test_a_torch_device_is_matched_to_its_tool_row_by_uuid_then_bus_then_index() -> None:
    devices = identity.parse_nvidia_ids(NVIDIA_IDS)
    assert identity.match(devices, "7f00aa00-1111-2222-3333-444455556666", None, 0) == (devices[1], "uuid")
    assert identity.match(devices, None, "0000:2A:00.0", 0) == (devices[1], "pci bus id")
    row, how = identity.match(devices, None, None, 0)
    assert row == devices[0] and how.startswith("index (unverified")
    assert identity.match(devices, None, None, 7) == (None, "not found in the vendor tool's list")
    assert identity.visible_index(1, {"CUDA_VISIBLE_DEVICES": "4,6"}) == 6
    assert identity.visible_index(0, {"CUDA_VISIBLE_DEVICES": "GPU-5e2b1a8c"}) is None
    assert identity.node_rank({"GROUP_RANK": "3"}) == 3 and identity.node_rank({"SLURM_NODEID": "7"}) == 7
    assert identity.normal_bus_id("00000000:9A:00.0") == identity.normal_bus_id("0000:9a:00.0") == "0000:9a:00.0"


def test_nvidia_topology_names_each_pair_of_gpus_link() -> None:
    matrix = identity.parse_nvidia_topology(NVIDIA_TOPOLOGY)
    assert matrix[(0, 1)] == "NV18" and matrix[(1, 2)] == "PIX" and matrix[(2, 0)] == "SYS" and (0, 0) not in matrix
    assert identity.describe_link_code("NV18") == "NVLink (18 links bonded, NV18)"
    assert identity.describe_link_code("SYS").startswith("PCIe and the inter-socket link")


# ---- the collective sweep per link --------------------------------------------------------------


def sweep_results(pairs: dict[str, int]) -> dict[str, dict]:
    case = {"op": "all_gather"}
    return {"all_gather-single-fp32-n7-outofplace": {"case": case, "wrong": sum(pairs.values()), "links": pairs},
            "all_reduce-sum-fp32-n7-inplace": {"case": {"op": "all_reduce"}, "wrong": 0, "links": {}}}


def cpu_rank(rank: int, node: int = 0) -> dict:
    return {"rank": rank, "host": "vm", "node_rank": node, "local_rank": rank, "device": "cpu"}


def test_a_single_corrupted_peer_names_its_link() -> None:
    results, ranks = sweep_results({"1->0": 6}), [cpu_rank(0), cpu_rank(1)]
    [finding] = links.findings(results, ranks, 2, "gloo")
    assert finding.check == "links" and finding.facts == {"pattern": "link"}
    message = described(finding)
    head, _, rest = message.partition(" (gloo over loopback) delivers wrong data: ")
    link = r"\[collective\] link rank (\d) \(node (\d) \(vm\), local (\d)\) -> rank (\d) \(node (\d) \(vm\), local (\d)\)"
    named = re.fullmatch(link, head)
    assert named is not None and named.groups() == ("1", "0", "1", "0", "0", "0"), message  # sender, then receiver
    assert rest.startswith("6 wrong elements in 1 of 2 cases"), message
    assert "every other pair of the 2 ranks" in rest and "is clean" in rest


def test_link_attribution_tells_a_link_from_a_sender_a_receiver_and_the_collective() -> None:
    assert links.attribute({(1, 0): 3}, 4) == ("link", [(1, 0)])
    assert links.attribute({(2, 0): 1, (2, 1): 1, (2, 3): 1}, 4)[0] == "sender"
    assert links.attribute({(0, 3): 1, (1, 3): 1, (2, 3): 1}, 4)[0] == "receiver"
    assert links.attribute({(s, r): 1 for s in range(3) for r in range(3) if s != r}, 3)[0] == "every"
    assert links.attribute({(1, 0): 1, (2, 3): 1}, 4)[0] == "several"
    assert links.attribute({}, 4) == ("clean", [])
    assert links.pair_counts(sweep_results({"0->0": 5})) == {}  # a rank's own chunk travels no link


def test_a_gpu_link_is_named_from_the_topology_and_across_nodes_as_the_network() -> None:
    gpus = [{**cpu_rank(r), "device": f"cuda:{r}", "smi_index": r, "links": {"1": "NV18"} if r == 0 else {}}
            for r in range(2)]
    assert links.link_kind(gpus, 0, 1, "nccl").split(": ") == ["nccl within node 0 (vm)", "NVLink (18 links bonded, NV18)"]
    unread = links.link_kind(gpus, 1, 0, "nccl")
    assert unread.startswith("nccl within node 0 (vm): ") and unread.endswith("(the topology was not read)")
    far = [gpus[0], {**gpus[1], "host": "other", "node_rank": 1}]
    assert links.link_kind(far, 1, 0, "nccl").split(" between ") == ["nccl over the network",
                                                                    "node 1 (other) and node 0 (vm)"]
    assert links.link_kind([cpu_rank(0), cpu_rank(1, node=1)], 1, 0, "gloo") == \
        "gloo over loopback between node 1 (vm) and node 0 (vm)"


def test_the_sweeps_own_failure_message_counts_wrong_elements_by_link() -> None:
    from pytest_gpuregress.scenarios.collectives import plan

    case = plan.Case("all_gather", "single", "", "fp32", 7, False)
    merged = plan.merge_rank_results([
        {case.id: {"case": case.to_json(), "nbytes": 56, "wrong": 6, "tail_wrong": 6, "bad_repeats": 2, "repeats": 3,
                   "first": {"index": 7, "expected": 1.0, "got": 2.0, "repeat": 1}, "error": None, "time_s": 0.0,
                   "links": {"1->0": 6}}},
        {case.id: {"case": case.to_json(), "nbytes": 56, "wrong": 0, "tail_wrong": 0, "bad_repeats": 0, "repeats": 3,
                   "first": None, "error": None, "time_s": 0.0, "links": {}}}])
    assert merged[case.id]["links"] == {"1->0": 6}
    problem = plan.problem(case, merged[case.id], 2)
    by_link = re.search(r"; wrong elements by link \(sender -> receiver\): (\d+) -> (\d+): (\d+)$", problem or "")
    assert by_link is not None and by_link.groups() == ("1", "0", "6"), problem


def test_the_sweep_counts_wrong_elements_by_their_sender() -> None:
    from pytest_gpuregress.scenarios.collectives import plan
    from pytest_gpuregress.scenarios.collectives.rank import _wrong_by_sender

    wrong = torch.zeros(4 * 3, dtype=torch.bool)
    wrong[[4, 5, 7]] = True  # chunks of 3: two in rank 1's, one in rank 2's
    gather = plan.Case("all_gather", "single", "", "fp32", 3, False)
    assert _wrong_by_sender(gather, wrong, 4) == {1: 2, 2: 1}
    assert _wrong_by_sender(plan.Case("broadcast", "", "", "fp32", 12, True), wrong, 4) == {3: 3}
    assert _wrong_by_sender(plan.Case("all_reduce", "", "sum", "fp32", 12, True), wrong, 4) == {}
    assert {c.op for c in plan.link_cases()} == set(links.ONE_SENDER_OPS)


# ---- the fault ----------------------------------------------------------------------------------


def test_the_matmul_fault_moves_one_element_exactly_one_ulp_and_is_undone() -> None:
    from types import SimpleNamespace

    from pytest_gpuregress.faults import parse
    from pytest_gpuregress.faults.matmul import install_matmul_ulp

    a, b = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), torch.ones(4, 2)
    clean = torch.matmul(a, b)
    ctx = SimpleNamespace(cleanup_hooks=[])
    firing = install_matmul_ulp(parse("matmul_ulp:rank=2,after=1"), ctx)
    try:
        assert torch.equal(torch.matmul(a, b), clean)  # after=1: the first call is left alone
        faulty = torch.matmul(a, b)
        layer = torch.nn.Linear(4, 2)
        layer(a).sum().backward()  # F.linear too, and autograd still works through it
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()
    assert firing.count == 2 and layer.weight.grad is not None
    assert (faulty != clean).sum() == 1
    value = clean[0, 0].item()
    away = np.inf if value > 0 else -np.inf
    assert faulty[0, 0].item() == float(np.nextafter(np.float32(value), np.float32(away)))
    assert torch.equal(torch.matmul(a, b), clean)  # undone


def test_ranks_run_in_process_vote_and_the_one_with_a_one_ulp_matmul_is_named(tmp_path: Path) -> None:
    """The rank code itself, three ranks in this process (no collective is needed: each is a world of one)."""
    from pytest_gpuregress.faults import install_counted
    from pytest_gpuregress.scenarios.base import Case, RankContext, Setup
    from pytest_gpuregress.scenarios.consensus import WORKLOAD
    from pytest_gpuregress.scenarios.consensus.rank import run

    records = []
    for rank in range(3):
        ctx = RankContext(rank, 3, rank, "cpu", "gloo", {**WORKLOAD, "steps": 1}, tmp_path)
        fired = install_counted(["matmul_ulp:rank=2"], ctx)
        try:
            records.append(run(ctx))
        finally:
            for undo in reversed(ctx.cleanup_hooks):
                undo()
        assert [f.count > 0 for f in fired] == ([True] if rank == 2 else [])  # installed on rank 2 only, and fired
    merged = SCENARIO.merge(records)
    assert merged.results["consensus"]["devices"][0]["tensors"] == 13 + 20 + 12  # a step's loss, 6 grads, 6 weights
    [message] = map(described, SCENARIO.own_findings(Case("devices"), merged, Setup("cpu", "gloo", 3)))
    assert message.startswith("[device] local 2 (cpu process, rank 2)") and " on node 0 (" in message
    assert "2 of 3 hold" in message
    assert "differs first at training step 0, " in message
    differing = [row for row in report.rows(vote_of(merged)) if row[2] == DISSENTS]
    assert len(differing) == 1 and "format casts" not in differing[0][3]
