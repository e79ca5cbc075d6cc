"""Device errors after which a rank's CUDA or HIP context is unusable: the rank must not serve another job.

These errors are sticky (every later call fails the same way), and a scenario may keep one as a finding and
still deliver, so the launcher matches them in what a rank reported and retires its group. Pure text matching.
"""

from __future__ import annotations

from collections.abc import Iterable

# The name the report gives each, and what to look for (lower case): the runtime's wording and its error enum's
# name both appear in torch's messages ("CUDA error: an illegal memory access was encountered", "HIP error:
# hipErrorIllegalAddress").
STICKY: dict[str, tuple[str, ...]] = {
    "illegal memory access": ("illegal memory access", "cudaerrorillegaladdress", "hiperrorillegaladdress",
                              "memory access fault by gpu"),  # the last: ROCr's own report of a page fault
    "unspecified launch failure": ("unspecified launch failure", "cudaerrorlaunchfailure", "hiperrorlaunchfailure"),
    "misaligned address": ("misaligned address", "cudaerrormisalignedaddress"),
    "device-side assert": ("device-side assert triggered", "cudaerrorassert", "hiperrorassert"),
    "uncorrectable ECC error": ("uncorrectable ecc error", "cudaerroreccuncorrectable", "hiperrorecc"),
    "uncorrectable NVLink error": ("uncorrectable nvlink error",),
    "illegal instruction": ("an illegal instruction was encountered", "cudaerrorillegalinstruction"),
    "invalid program counter": ("invalid program counter",),
    "hardware stack error": ("hardware stack error",),
    "kernel launch timeout": ("the launch timed out and was terminated", "cudaerrorlaunchtimeout",
                              "hiperrorlaunchtimeout"),
}


def sticky_device_error(text: str) -> str | None:
    """The sticky device error ``text`` reports ("illegal memory access"), or None. Out of memory, an invalid argument
    or a missing kernel image are recoverable, and the hint torch appends to every CUDA error ("... to enable
    device-side assertions") matches nothing."""
    lowered = text.lower()
    return next((name for name, needles in STICKY.items() if any(n in lowered for n in needles)), None)


def first_sticky(texts: Iterable[str]) -> str | None:
    """The first sticky device error among ``texts``."""
    return next((found for text in texts if (found := sticky_device_error(text))), None)
