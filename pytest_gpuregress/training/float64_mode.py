"""The float64 oracle computed in float64 throughout, even where the model's own code asks for less.

transformers' ``LlamaRMSNorm`` computes every norm after ``hidden_states.to(torch.float32)``, and its rotary
embedding computes its angles with ``.float()``: a model cast to float64 still rounds there to float32, so an
oracle that merely casts the model is float32 at its norms. ``Float64Throughout`` is a dispatch mode (below
autograd, so the backward pass is held to it too) that turns every op's request for a lower floating dtype
(``dtype=float32``: ``_to_copy``, a factory) into float64, and lists the ops that still produced a lower one: the
oracle's record says which, if any, were not float64.

    with float64_throughout() as mode:
        loss = ...; loss.backward()
    mode.not_float64    # ["aten::..."], [] where every floating output was float64

MODE is stored with a reference's oracle step 0 (evidence/oracle_step0.py). Torch is imported inside the
functions: only the ranks call them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MODE = "float64 throughout"


@contextmanager
def float64_throughout() -> Iterator[Any]:
    """Run the body with every lower floating dtype an op asks for made float64."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    low = (torch.float32, torch.float16, torch.bfloat16)

    class Float64Throughout(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.found: set[str] = set()

        @property
        def not_float64(self) -> list[str]:
            return sorted(self.found)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if kwargs.get("dtype") in low:
                kwargs = {**kwargs, "dtype": torch.float64}
            out = func(*args, **kwargs)
            for tensor in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != torch.float64:
                    self.found.add(str(getattr(func, "_schema", func).name) if hasattr(func, "_schema") else str(func))
            return out

    with Float64Throughout() as watching:
        yield watching
