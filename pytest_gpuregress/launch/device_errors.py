"""Device errors after which a rank's CUDA or HIP context is unusable: the rank must not serve another job.

CUDA and HIP make some errors sticky: after an illegal memory access, a launch failure, a misaligned
address, a device-side assert or an uncorrectable ECC error, every later call in the process fails with
the same error, and only a new process gets a working context. Scenarios report some device errors as
findings and carry on (a collective or a ``_scaled_mm`` that raises is a finding, not a crash), so the
rank delivers its record; reused, it would fail every later case with an error that is not theirs. The
launcher looks for these messages in what a rank reported (spawn.py) and retires its group.

Pure: matched on message text, as torch, the CUDA runtime and HIP word them.
"""

from __future__ import annotations

from collections.abc import Iterable

# (what to look for, lower case; the name the report gives it). The runtime's wording and its error
# enum's name both appear in torch's messages ("CUDA error: an illegal memory access was encountered",
# "HIP error: hipErrorIllegalAddress").
STICKY: tuple[tuple[str, str], ...] = (
    ("illegal memory access", "illegal memory access"),
    ("cudaerrorillegaladdress", "illegal memory access"),
    ("hiperrorillegaladdress", "illegal memory access"),
    ("memory access fault by gpu", "illegal memory access"),  # ROCr's own report of a page fault
    ("unspecified launch failure", "unspecified launch failure"),
    ("cudaerrorlaunchfailure", "unspecified launch failure"),
    ("hiperrorlaunchfailure", "unspecified launch failure"),
    ("misaligned address", "misaligned address"),
    ("cudaerrormisalignedaddress", "misaligned address"),
    ("device-side assert triggered", "device-side assert"),
    ("cudaerrorassert", "device-side assert"),
    ("hiperrorassert", "device-side assert"),
    ("uncorrectable ecc error", "uncorrectable ECC error"),
    ("cudaerroreccuncorrectable", "uncorrectable ECC error"),
    ("hiperrorecc", "uncorrectable ECC error"),
    ("uncorrectable nvlink error", "uncorrectable NVLink error"),
    ("an illegal instruction was encountered", "illegal instruction"),
    ("cudaerrorillegalinstruction", "illegal instruction"),
    ("invalid program counter", "invalid program counter"),
    ("hardware stack error", "hardware stack error"),
    ("the launch timed out and was terminated", "kernel launch timeout"),
    ("cudaerrorlaunchtimeout", "kernel launch timeout"),
    ("hiperrorlaunchtimeout", "kernel launch timeout"),
)


def sticky_device_error(text: str) -> str | None:
    """The sticky device error ``text`` reports ("illegal memory access"), or None.

    Recoverable errors are not sticky: out of memory, an invalid argument, a missing kernel image. Nor is
    the hint torch appends to every CUDA error ("... to enable device-side assertions")."""
    lowered = text.lower()
    return next((name for needle, name in STICKY if needle in lowered), None)


def first_sticky(texts: Iterable[str]) -> str | None:
    """The first sticky device error among ``texts``."""
    return next((found for text in texts if (found := sticky_device_error(text))), None)
