"""A misread inside the stack's own checkpoint loaders: fp8 bytes handed back as another format's dtype.

The NVIDIA-checkpoint-on-MI300 bug where it really sits, in the loading library. The ``format`` kind's
``loader_*`` modes wrap the chosen ``path``'s loader (safetensors, safe_open, torch.load, DCP, transformers);
each tensor of the source dtype comes back as a view in the target dtype and counts as one firing.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import FaultSpec
from .fired import Firing, patch

# mode -> (the torch dtype the loader misreads, the one it hands the bytes back as)
MODES: dict[str, tuple[str, str]] = {
    "loader_fn_as_fnuz": ("float8_e4m3fn", "float8_e4m3fnuz"),  # an NVIDIA checkpoint read on MI300
    "loader_e5m2_as_e4m3fn": ("float8_e5m2", "float8_e4m3fn"),  # one fp8 tag taken for the other
    "loader_bf16_as_fp16": ("bfloat16", "float16"),  # BF16 taken for F16: the two 16-bit floats confused
}


def install(spec: FaultSpec, ctx: Any) -> Firing:
    from ..scenarios.formats.catalog import IO_PATHS

    firing = Firing(spec.text)
    source, target = MODES[spec.get("mode")]
    wrong = Misread(firing, source, target)
    paths = [spec.get("path")] if spec.get("path") else list(IO_PATHS)
    for path in paths:
        module_name, attribute, wrap = TARGETS[path]
        patch(ctx, importlib.import_module(module_name), attribute, functools.partial(wrap, wrong))
    return firing


@dataclass(frozen=True)
class Misread:
    firing: Firing
    source: str  # torch dtype names
    target: str

    def __call__(self, value: Any) -> Any:
        """``value`` with every ``source`` tensor in it (a tensor, or a dict of them) viewed as ``target``."""
        import torch

        if isinstance(value, dict):
            return {key: self(item) for key, item in value.items()}
        if isinstance(value, torch.Tensor) and value.dtype == getattr(torch, self.source):
            self.firing.fire()
            from torch.distributed.tensor import DTensor

            return (value.to_local() if isinstance(value, DTensor) else value).view(getattr(torch, self.target))
        return value


def _returning(misread: Misread, load: Callable[..., Any]) -> Callable[..., Any]:
    def misreading_load(*args: Any, **kwargs: Any) -> Any:
        return misread(load(*args, **kwargs))

    return misreading_load


def _filling(misread: Misread, load: Callable[..., Any]) -> Callable[..., Any]:
    """DCP loads in place: the state dict's misread entries are replaced after the real load."""

    def misreading_load(state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        result = load(state_dict, *args, **kwargs)
        state_dict.update(misread(dict(state_dict)))
        return result

    return misreading_load


class _Slice:
    """A safe_open slice (and, below, handle) whose tensors come back misread; everything else is the real one's."""

    def __init__(self, inner: Any, misread: Misread) -> None:
        self._inner, self._misread = inner, misread

    def __getitem__(self, index: Any) -> Any:
        return self._misread(self._inner[index])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Handle(_Slice):
    def __enter__(self) -> _Handle:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def get_tensor(self, name: str) -> Any:
        return self._misread(self._inner.get_tensor(name))

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self._inner.get_slice(name), self._misread)


def _opening(misread: Misread, safe_open: Callable[..., Any]) -> Callable[..., Any]:
    def misreading_open(*args: Any, **kwargs: Any) -> _Handle:
        return _Handle(safe_open(*args, **kwargs), misread)

    return misreading_open


# path -> (module, attribute, wrapper)
TARGETS: dict[str, tuple[str, str, Callable[[Misread, Callable[..., Any]], Callable[..., Any]]]] = {
    "safetensors": ("safetensors.torch", "load_file", _returning),
    "safe_open": ("safetensors", "safe_open", _opening),
    "torch_load": ("torch", "load", _returning),
    "dcp": ("torch.distributed.checkpoint", "load", _filling),
    "transformers": ("transformers.modeling_utils", "safe_open", _opening),
}
