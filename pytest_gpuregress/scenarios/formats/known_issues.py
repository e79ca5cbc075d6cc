"""Known failures of the stack's own checkpoint I/O with fp8 and fp4 tensors, with the versions they were seen in.

A stack library that cannot do what it should is a finding, never a reason to route around it: an ``io-<path>``
error matching an entry is reported by name with a warning, any other fails. torch-free: the session imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownIssue:
    name: str
    library: str
    calls: tuple[str, ...]  # the calls of stack_io it shows in ("save_file", "get_tensor", ...)
    symptom: str  # a regular expression over "ExceptionType: message"
    tags: tuple[str, ...]  # the file must hold one of these safetensors tags: the issue is about them
    versions: dict[str, str]  # distribution -> PEP 440 specifier the installed version must meet
    what: str
    seen_with: str  # the versions it was measured with

    def describe(self, library_version: str) -> str:
        return (f"known issue {self.name} of {self.library} {library_version}: {self.what} "
                f"(seen with {self.seen_with})")


KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue("safetensors-no-fnuz", "safetensors", ("save_file", "load_file", "get_tensor", "get_slice"),
               r"float8_e[45]m[23]fnuz|F8_E[45]M[23]FNUZ", ("F8_E4M3FNUZ", "F8_E5M2FNUZ"), {"safetensors": "<0.8"},
               "cannot write torch.float8_e4m3fnuz or float8_e5m2fnuz (KeyError) nor read the F8_E4M3FNUZ and "
               "F8_E5M2FNUZ tags (unknown variant), so MI300's fp8 checkpoints cannot go through it; safetensors 0.8.0 "
               "does both",
               "safetensors 0.4.5, 0.5.3, 0.6.2 and 0.7.0 on torch 2.13 (e5m2fnuz measured with 0.7.0)"),
    KnownIssue("safetensors-no-mx-tags", "safetensors", ("save_file", "load_file", "get_tensor", "get_slice"),
               r"float8_e8m0fnu|float4_e2m1fn_x2|InvalidHeaderDeserialization", ("F8_E8M0", "F4"),
               {"safetensors": "<0.6"},
               "cannot write torch.float8_e8m0fnu or float4_e2m1fn_x2 (KeyError) nor read the F8_E8M0 and F4 tags "
               "(InvalidHeaderDeserialization), so MX checkpoints cannot go through it; 0.6.2 and later do",
               "safetensors 0.4.5 and 0.5.3 on torch 2.13"),
    KnownIssue("safetensors-e8m0-keyerror", "safetensors", ("load_file", "get_tensor", "get_slice"),
               r"KeyError: .*F8_E8M0", ("F8_E8M0",), {"torch": "<2.7"},
               "raises KeyError reading the F8_E8M0 tag it writes itself: its torch loader has no dtype for it",
               "a torch without float8_e8m0fnu (before 2.7); not reproduced with safetensors 0.4.5 to 0.8.0 on torch 2.13"),
    KnownIssue("safetensors-f4-safe-open", "safetensors", ("get_slice",),
               r"shape '\[[0-9, ]*\]' is invalid for input of size", ("F4",), {"safetensors": ">=0.8"},
               "safe_open's get_slice takes the F4 tag's element count for the float4_e2m1fn_x2 shape and raises; "
               "get_tensor and load_file read the same file correctly",
               "safetensors 0.8.0 on torch 2.13 (0.6.2 and 0.7.0 read it)"),
    KnownIssue("torch-fp4-deterministic", "torch", ("torch.load", "dcp.load"),
               r"fill_empty_deterministic_\" not implemented for 'Float4_e2m1fn_x2'", ("F4",), {},
               "torch.load and torch.distributed.checkpoint cannot create float4_e2m1fn_x2 tensors under "
               "torch.use_deterministic_algorithms(True): filling new memory (torch.utils.deterministic."
               "fill_uninitialized_memory, on by default) has no fp4 kernel, so MX fp4 checkpoints do not load in a "
               "deterministic run",
               "torch 2.13.0 (CPU)"),
)


def installed(distribution: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None


def _versions_hold(required: dict[str, str]) -> bool:
    """Every installed distribution in its range; a local build suffix (2.13.0+cpu) does not count."""
    from packaging.specifiers import SpecifierSet

    from ...stack.known_issues import parse_version

    for distribution, spec in required.items():
        version = parse_version(installed(distribution))
        if version is None or version not in SpecifierSet(spec):
            return False
    return True


def match(library: str, call: str, error: str, tags: frozenset[str] = frozenset()) -> KnownIssue | None:
    """The known issue ``error`` ("Type: message", raised by ``call`` of ``library`` on a file holding ``tags``)
    is, or None: the call, the symptom, a tag the issue is about, and the installed versions must all fit."""
    return next((issue for issue in KNOWN_ISSUES if issue.library == library and call in issue.calls
                 and re.search(issue.symptom, error) and (not issue.tags or tags & set(issue.tags))
                 and _versions_hold(issue.versions)), None)
