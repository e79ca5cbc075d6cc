"""The vote: group devices by model and stack, take each group's majority result, name every device that differs.

A result held by more than half of a group is the consensus; every other device dissents. Without one, it is
"no majority" and nobody is called wrong. Groups never vote against each other. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .group_key import key_id

AGREES, DISSENTS, NO_MAJORITY, ALONE = "agrees", "DISSENTS", "no majority", "alone"


@dataclass(frozen=True, eq=False)  # compared by identity: a fleet holds thousands, each with its digests
class Device:
    """One device's identity, group key and digests, as the merged record carries them."""

    rank: int
    identity: dict[str, Any]
    key: dict[str, Any]
    names_sha: str
    hashes: tuple[str, ...]
    sums: tuple[float, ...]
    magnitudes: tuple[float, ...]
    firmware: str | None = None

    @property
    def result(self) -> tuple[str, tuple[str, ...]]:
        return self.names_sha, self.hashes

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Device:
        return cls(int(data["rank"]), dict(data["identity"]), dict(data["key"]), str(data["names_sha"]),
                   tuple(data["hashes"]), tuple(float(x) for x in data["sums"]),
                   tuple(float(x) for x in data["magnitudes"]), data.get("firmware"))


@dataclass(frozen=True)
class Difference:
    """Where a device's digests first differ from another's. ``index`` None: it ran another workload."""

    index: int | None
    ours: float = 0.0  # the float64 sum of the tensor on the device that differs
    theirs: float = 0.0  # ... and on the device it is compared with
    magnitude: float = 0.0  # the other's sum of |x|: what a relative difference is relative to
    differing: int = 0  # digests that differ in all
    total: int = 0

    @property
    def relative(self) -> float:
        scale = self.magnitude or abs(self.theirs)
        return abs(self.ours - self.theirs) / scale if scale else float(self.ours != self.theirs)


def first_difference(device: Device, against: Device) -> Difference | None:
    """The first digest where ``device`` differs from ``against`` (None when their results are equal)."""
    if device.result == against.result:
        return None
    if device.names_sha != against.names_sha or len(device.hashes) != len(against.hashes):
        return Difference(None, total=len(against.hashes))
    differing = [i for i, (a, b) in enumerate(zip(device.hashes, against.hashes)) if a != b]
    i = differing[0]
    return Difference(i, device.sums[i], against.sums[i], against.magnitudes[i], len(differing), len(device.hashes))


@dataclass
class Group:
    """Devices of one model and stack, and how their results split."""

    key: dict[str, Any]
    devices: list[Device]
    results: list[list[Device]] = field(default_factory=list)  # devices by equal result, the largest first

    @cached_property
    def _result_of(self) -> dict[int, int]:
        """id(device) -> the index of its result in ``results``."""
        return {id(d): number for number, devices in enumerate(self.results) for d in devices}

    @property
    def majority(self) -> list[Device] | None:
        """The devices holding the consensus result, or None without a majority (or alone)."""
        if len(self.devices) < 2 or 2 * len(self.results[0]) <= len(self.devices):
            return None
        return self.results[0]

    @property
    def outcome(self) -> str:
        if len(self.devices) == 1:
            return ALONE
        if len(self.results) == 1:
            return AGREES
        return DISSENTS if self.majority is not None else NO_MAJORITY

    def outcome_of(self, device: Device) -> str:
        if len(self.devices) == 1:
            return ALONE
        if self.majority is None:
            return NO_MAJORITY
        return AGREES if self._result_of[id(device)] == 0 else DISSENTS

    def compared_with(self, device: Device) -> Device | None:
        """The device whose result ``device`` is measured against: the consensus (or, without one, the largest
        result's first device); None for a device that holds it."""
        return None if self._result_of[id(device)] == 0 else self.results[0][0]

    @property
    def dissenters(self) -> list[Device]:
        if self.majority is None:
            return []
        return [d for devices in self.results[1:] for d in devices]


@dataclass
class Vote:
    names: list[str]
    kinds: list[str]
    groups: list[Group]  # the largest first

    @property
    def devices(self) -> list[Device]:
        return [d for g in self.groups for d in g.devices]

    @property
    def outcome(self) -> str:
        """"no majority" if any group has none, else "DISSENTS" if any has a dissenter, else "agrees"."""
        outcomes = {g.outcome for g in self.groups}
        return next((v for v in (NO_MAJORITY, DISSENTS) if v in outcomes), AGREES)


def vote(devices: list[Device], names: list[str], kinds: list[str]) -> Vote:
    """Group ``devices`` by key and split each group by result; largest groups and results first, ties by rank."""
    by_key: dict[str, Group] = {}
    for device in sorted(devices, key=lambda d: d.rank):
        by_key.setdefault(key_id(device.key), Group(device.key, [])).devices.append(device)
    for group in by_key.values():
        by_result: dict[tuple[str, tuple[str, ...]], list[Device]] = {}
        for device in group.devices:
            by_result.setdefault(device.result, []).append(device)
        group.results = sorted(by_result.values(), key=lambda ds: (-len(ds), ds[0].rank))
    groups = sorted(by_key.values(), key=lambda g: (-len(g.devices), g.devices[0].rank))
    return Vote(list(names), list(kinds), groups)
