"""A tensor's digest, computed where the tensor lives: float64 sum, sum of |x|, max |x|, and a hash of its bits.

hash = sum_i bits(x_i) * (2 i + 1) * K (mod 2**64), K odd, in wrapping int64: independent of reduction
order, changed by any one element's bits (odd weights are invertible) and by elements trading places.
Only four numbers cross to the host per output.
"""

from __future__ import annotations

import functools
from typing import Any

HASH_KIND = "wsum64/1"  # stored with each trace: hashes of another kind are not compared bit for bit
# The sketch: a floating output's signed sums over interleaved buckets, element i in bucket i mod SKETCH_BUCKETS.
# A whole-tensor sum dilutes one wrong element among tens of thousands, where a clean run on another kernel path
# moves every element by an ulp or so; in a bucket of n / 127 elements the one element stands out against the
# others' drift, which mostly cancels (evidence/introduced.py). 127 is prime, so no row length of a power of two
# lines a bucket up with a column: a row or column that moved together spreads over every bucket. Outputs under
# SKETCH_MIN_ELEMENTS keep no sketch (their buckets would hold a few elements each).
SKETCH_BUCKETS = 127
SKETCH_MIN_ELEMENTS = 1024
CHUNK = 1 << 24  # elements digested at a time on a device: 512 MiB of float64 and int64 temporaries
_K = 0x9E3779B97F4A7C15 - (1 << 64)  # the 64-bit golden ratio, odd, as a signed int64
_INT_OF_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def bits_as_int64(flat: Any) -> Any:
    """The bit pattern of each element of the contiguous 1-D ``flat``, widened to int64 (sign-extended)."""
    import torch

    if flat.dtype == torch.bool:
        return flat.to(torch.int64)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(getattr(torch, _INT_OF_WIDTH[flat.element_size()])).to(torch.int64)


def digest(tensor: Any) -> tuple[float, float, float, int]:
    """(sum, sum of |x|, max |x|) in float64, and the bits hash, of ``tensor`` (read only, on its device)."""
    return digest_and_sketch(tensor, sketch=False)[0]


def digest_and_sketch(tensor: Any, *, sketch: bool = True) -> tuple[tuple[float, float, float, int], Any]:
    """``digest(tensor)`` and, for a floating tensor of SKETCH_MIN_ELEMENTS or more, its ``sketch`` (a float64
    numpy array of SKETCH_BUCKETS signed sums); None otherwise (and with ``sketch`` false). On a device both are
    computed there and only the numbers cross."""
    import torch

    floating = tensor.is_floating_point() and not tensor.is_complex()
    wanted = sketch and floating and tensor.numel() >= SKETCH_MIN_ELEMENTS
    if tensor.device.type not in ("cpu", "meta"):
        wait_for_writers(tensor.device)
    if tensor.device.type == "cpu" and tensor.dtype in _numpy_dtypes():
        # Read through numpy: a few calls instead of a dozen torch ops (the trace digests hundreds of small outputs).
        # The hash is the same either way; the float64 sums may differ in their last bits, which is why equality is
        # judged by the hash (evidence/first_moved.py). A copy, once for both: numpy's view of a tensor's own
        # storage would make it non-resizable, and FSDP2 frees its unsharded parameters by resizing it to 0.
        values = tensor.detach().clone(memory_format=torch.contiguous_format).numpy()
        return numpy_digest(values), numpy_sketch(values) if wanted else None
    return torch_digest(tensor), torch_sketch(tensor) if wanted else None


def numpy_sketch(values: Any) -> Any:
    import numpy as np

    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    padded = np.zeros(-(-flat.size // SKETCH_BUCKETS) * SKETCH_BUCKETS)
    padded[:flat.size] = flat
    return padded.reshape(-1, SKETCH_BUCKETS).sum(axis=0)


def torch_sketch(tensor: Any) -> Any:
    """The sketch by torch ops on the tensor's device, in chunks of a multiple of SKETCH_BUCKETS elements."""
    import torch

    with torch.no_grad():
        flat = tensor.detach().contiguous().reshape(-1)
        sums = torch.zeros(SKETCH_BUCKETS, dtype=torch.float64, device=flat.device)
        step = CHUNK - CHUNK % SKETCH_BUCKETS
        for start in range(0, flat.numel(), step):
            part = flat[start:start + step].to(torch.float64)
            whole = part.numel() - part.numel() % SKETCH_BUCKETS
            sums += part[:whole].view(-1, SKETCH_BUCKETS).sum(dim=0)
            sums[:part.numel() - whole] += part[whole:]
        return sums.cpu().numpy()


def wait_for_writers(device: Any) -> None:
    """Wait until every stream of ``device`` has finished: FSDP2 at world size 1 copies into the reduce-scatter's output
    on its own stream, and the next op's hook digests it on the default stream before the program's own wait, racing
    the copy. Step 0 only, so a whole-device synchronisation costs little; it changes no number the training computes."""
    import torch

    backend = getattr(torch, device.type, None)  # torch.cuda (ROCm too), torch.xpu, torch.mps
    synchronize = getattr(backend, "synchronize", None)
    if synchronize is None:
        return
    if device.type == "mps":  # one device, and its synchronize takes none
        synchronize()
    else:
        synchronize(device)


def numpy_digest(values: Any) -> tuple[float, float, float, int]:
    flat = values.reshape(-1)
    if flat.size == 0:
        return 0.0, 0.0, 0.0, 0
    wide = flat.astype("float64")
    magnitude = abs(wide)
    return float(wide.sum()), float(magnitude.sum()), float(magnitude.max()), numpy_hash(flat)


def torch_digest(tensor: Any) -> tuple[float, float, float, int]:
    """The digest by torch ops on the tensor's device; one synchronisation, four numbers to the host."""
    import torch

    with torch.no_grad():
        flat = tensor.detach().contiguous().reshape(-1)
        if flat.numel() == 0:
            return 0.0, 0.0, 0.0, 0
        sums = torch.zeros(3, dtype=torch.float64, device=flat.device)  # sum, sum of |x|, max |x|
        hashed = torch.zeros((), dtype=torch.int64, device=flat.device)
        # In chunks: the float64 and int64 temporaries of a logits-sized output would take GiBs at once.
        for start in range(0, flat.numel(), CHUNK):
            part = flat[start:start + CHUNK]
            wide = (torch.view_as_real(part).reshape(-1) if part.is_complex() else part).to(torch.float64)
            magnitude = wide.abs()
            sums += torch.stack([wide.sum(), magnitude.sum(), torch.zeros_like(sums[2])])
            sums[2] = torch.maximum(sums[2], magnitude.max())
            index = torch.arange(start, start + part.numel(), device=flat.device, dtype=torch.int64)
            hashed += (bits_as_int64(part) * ((index * 2 + 1) * _K)).sum()
        # One transfer: the hash travels as the bits of a float64, viewed back on the host.
        row = torch.cat([sums, hashed.view(torch.float64).reshape(1)]).cpu()
    total, abs_total, max_abs = (float(v) for v in row[:3])
    return total, abs_total, max_abs, int(row[3:].view(torch.int64)[0])


def _numpy_dtypes() -> frozenset[Any]:
    import torch

    return frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                      torch.uint8, torch.bool})


def numpy_hash(values: Any) -> int:
    """The hash of a numpy array, in numpy's uint64 arithmetic (wrapping by definition): the CPU path of
    ``digest``, and the check that torch's int64 arithmetic, used on other devices, wraps the same way."""
    import numpy as np

    flat = np.ascontiguousarray(values).reshape(-1)
    ints = flat.view(f"int{8 * flat.itemsize}" if flat.itemsize > 1 else "uint8").astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        total = int(np.sum(ints * _weights(flat.size), dtype=np.uint64))
    return total - (1 << 64) if total >= 1 << 63 else total


def _weights(size: int) -> Any:
    """(2 i + 1) K mod 2**64 for i < size; kept for the small sizes a trace meets again and again."""
    return _weights_of(size) if size <= 1 << 20 else _weights_of.__wrapped__(size)


@functools.lru_cache(maxsize=32)
def _weights_of(size: int) -> Any:
    import numpy as np

    with np.errstate(over="ignore"):
        return (np.arange(size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * np.uint64(_K + (1 << 64))
