"""Device errors after which a rank's CUDA or HIP context is unusable: the rank must not serve another job.

These errors are sticky (every later call fails the same way), and a scenario may keep one as a finding and
still deliver, so the launcher matches them in what a rank reported and retires its group. Pure text matching.
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
