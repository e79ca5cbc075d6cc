"""The float64 oracle: step 0 of a training scenario's model and global batch, in float64 on the CPU, in one
process with no sharding or faults; a real run's step 0 must agree within its dtype's bound (triage/scenario.py).

A model cast to float64 still rounds to float32 where its code asks (``LlamaRMSNorm``'s ``.to(torch.float32)``,
rotary ``.float()``): ``float64_throughout`` is a dispatch mode (below autograd, so backward too) that makes each
such request float64 and lists the ops that still produced a lower dtype, for the record (oracle_step0.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..evidence import step0
from ..evidence.oracle_step0 import MODE_KEY
from ..reference.record import RunRecord
from .data import token_source
from .models import blueprint, build_causal_lm
from .moe import in_float64
from .seeding import usable_cpus

MODE = "float64 throughout"  # kept with every oracle step 0: change it when the oracle computes otherwise


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
                    self.found.add(str(func._schema.name) if hasattr(func, "_schema") else str(func))
            return out

    with Float64Throughout() as watching:
        yield watching


def float64_step0(model: Any, cfg: dict[str, Any], vocab_size: int) -> tuple[float, dict[str, Any]]:
    """Step 0's loss on the whole global batch, backward done, all in float64 (on every usable CPU: float64 is
    slow), and what the record keeps of the mode: its name and the ops that were not float64."""
    import torch

    torch.set_num_threads(usable_cpus())
    model = in_float64(model)
    tokens = torch.from_numpy(token_source(cfg, vocab_size).global_batch_at(0))
    with float64_throughout() as watching:
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
    return float(loss.detach()), {"mode": MODE, "not_float64": watching.not_float64}


def run(ctx) -> RunRecord:  # type: ignore[no-untyped-def]
    """Rank entry (one rank): build the model as the scenario does, in float64, and take step 0's gradients."""
    import torch

    cfg = ctx.config
    model_config = blueprint(cfg)
    model = build_causal_lm(model_config, seed=int(cfg["seed"]))
    loss, mode = float64_step0(model, cfg, model_config.vocab_size)
    names = [n for n, _ in model.named_parameters()]
    # A parameter the loss does not use has no gradient: zero, as the scenario records it.
    whole = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    norms = np.asarray([[float(g.norm()) for g in whole.values()]], dtype=np.float64)
    grads: dict[str, np.ndarray] = {}
    for n, g in whole.items():
        grads.update(step0.shard_arrays(n, g.detach().numpy(), tuple(g.shape), 0, 1, step0.full_max_of(cfg)))
    return RunRecord(scenario="oracle", config=dict(cfg), platform_key="", world_size=1,
                     series={"loss": [loss]}, param_names=names, results={MODE_KEY: mode},
                     arrays={"param_grad_norm": norms, **grads})
