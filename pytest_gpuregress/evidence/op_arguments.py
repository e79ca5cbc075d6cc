"""What an op of the step-0 trace was called with besides tensors, and whose code called it.

Scalars, flags, dtypes and a strided view's offset and strides show a library that calls an op otherwise
(a loss divided by 2, an adapter scaled differently), which no tensor digest shows. ``package`` is the
top-level package whose code ran the op. Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

import sys
from typing import Any

# Frames that only carry a call to the dispatcher: torch's, the tracer's own.
_PLUMBING = ("torch/utils/_python_dispatch", "torch/utils/_debug_mode", "torch/_ops.py", "torch/overrides.py",
             "torch/_tensor.py", "torch/_compile.py", "torch/_dynamo/", "pytest_gpuregress/evidence/op_trace",
             "pytest_gpuregress/evidence/op_arguments", "pytest_gpuregress/evidence/tensor_digest")
# Classes a module is wrapped in that run no code of the model's: FSDP2's FSDP<Class>, DDP's, checkpoint wrappers.
_WRAPPERS = ("torch.distributed.",)


def _scalar_text(value: Any) -> str | None:
    """The text of a non-tensor argument; None for a tensor, a list holding one, or an object of no fixed value
    (a process group, a generator)."""
    import torch

    if isinstance(value, (bool, int, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, (float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)) and value:
        texts = [_scalar_text(v) for v in value]
        return None if any(t is None for t in texts) else f"[{', '.join(texts)}]"  # type: ignore[arg-type]
    return None


def arguments_text(func: Any, args: Any, kwargs: Any) -> str:
    """"name=value, ..." of the non-tensor arguments passed (None and the defaults not passed are left out)."""
    schema = getattr(func, "_schema", None)  # a higher-order operator has none
    if schema is None:
        return ""
    parts = []
    for i, argument in enumerate(schema.arguments):
        if i < len(args):
            value = args[i]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            continue
        text = _scalar_text(value)
        if text is not None:
            parts.append(f"{argument.name}={text}")
        elif _strided_view(value):
            parts.append(f"{argument.name}@{value.storage_offset()}:{list(value.stride())}")
    return ", ".join(parts)


def _strided_view(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_contiguous()


def module_package(module: Any) -> str:
    """The top-level package of the code a module runs: its class's, past wrapper classes."""
    for cls in type(module).__mro__:
        name = str(getattr(cls, "__module__", "") or "")
        if name and not name.startswith(_WRAPPERS):
            return name.split(".")[0]
    return ""


def calling_package() -> str:
    """The top-level package of the innermost Python frame that is not dispatch plumbing ("" where none is)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if not any(part in filename for part in _PLUMBING):
            return str(frame.f_globals.get("__name__", "")).split(".")[0]
        frame = frame.f_back  # type: ignore[assignment]
    return ""
