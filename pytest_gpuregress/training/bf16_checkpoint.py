"""The bf16 lane's checkpoint: its trained weights in bf16, written and read back through the stack's own I/O.

Every tensor must come back as bf16 with the same bits, through safetensors and ``torch.load``: a check with
no reference, since a file is a copy on every stack. Loaders are looked up at call time so a fault placed in
one (faults/loaders.py) is what runs. Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..findings import CheckFinding

CONFIG_KEY = "bf16_checkpoint"  # a run's config: True where the run writes and reads its bf16 weights (the bf16 lane)
RESULT_KEY = "bf16_checkpoint"  # a training record's results: what was written, and each problem found
PATHS = ("safetensors", "safe_open", "torch_load")  # the readers, as faults/loaders.py names their paths
SHOWN = 3  # problems named per reader


def round_trip(weights: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """Write ``weights`` (whole tensors) as bf16 into ``folder``; read them back through every path of PATHS."""
    import torch

    written = {name: w.detach().to(torch.bfloat16).contiguous().cpu() for name, w in weights.items()}
    readers = _readers(written, folder)
    problems: list[str] = []
    for path, read in readers.items():
        try:
            loaded = read()
        except Exception as exc:  # noqa: BLE001 - a reader that fails is the finding
            problems.append(f"{path}: reading failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        problems.extend(f"{path}: {problem}" for problem in differences(written, loaded)[:SHOWN])
    return {"tensors": len(written), "bytes": sum(t.numel() * 2 for t in written.values()), "paths": list(readers),
            "problems": problems}


def _readers(written: dict[str, Any], folder: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    import safetensors
    import safetensors.torch
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    tensors, pickled = folder / "weights-bf16.safetensors", folder / "weights-bf16.pt"
    safetensors.torch.save_file(written, str(tensors))
    torch.save(written, pickled)

    def through_safe_open() -> dict[str, Any]:
        with safetensors.safe_open(str(tensors), framework="pt") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - a handle, not a dict

    return {"safetensors": lambda: safetensors.torch.load_file(str(tensors)),
            "safe_open": through_safe_open,
            "torch_load": lambda: torch.load(pickled, weights_only=True)}


def differences(written: Mapping[str, Any], loaded: Mapping[str, Any]) -> list[str]:
    """Each tensor of ``written`` that ``loaded`` lacks, or gives back in another dtype, shape or bits."""
    import torch

    out = []
    for name, tensor in written.items():
        got = loaded.get(name)
        if got is None:
            out.append(f"{name} is missing")
        elif got.dtype != tensor.dtype:
            out.append(f"{name} came back as {got.dtype}, written as {tensor.dtype}")
        elif tuple(got.shape) != tuple(tensor.shape):
            out.append(f"{name} came back shaped {list(got.shape)}, written {list(tensor.shape)}")
        else:
            moved = int((got.view(torch.int16) != tensor.view(torch.int16)).sum())
            if moved:
                out.append(f"{name}: {moved} of {tensor.numel()} values differ bitwise")
    return out


def findings(result: Mapping[str, Any] | None) -> list[CheckFinding]:
    """The reference-free findings of a record's round trip (triage names their component)."""
    if not result:
        return []
    return [CheckFinding("checkpoint", f"bf16 checkpoint of the trained weights ({result['tensors']} tensors) "
                                       f"through {problem}") for problem in result.get("problems", [])]
