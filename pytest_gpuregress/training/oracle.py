"""The float64 oracle: step 0 of a training scenario's model and global batch, in float64 on the CPU.

One process, no sharding, no faults. A real run's step 0 must agree within a bound set by its compute
dtype (triage/scenario.py). ``float64_step0`` is shared with the lora scenario's oracle.

It is computed in float64 throughout, even where the model's own code asks for less. transformers'
``LlamaRMSNorm`` computes every norm after ``hidden_states.to(torch.float32)``, and its rotary embedding
computes its angles with ``.float()``: a model cast to float64 still rounds there to float32, so an oracle
that merely casts the model is float32 at its norms. ``float64_throughout`` runs a dispatch mode (below
autograd, so the backward pass is held to it too) that turns every op's request for a lower floating dtype
(``dtype=float32``: ``_to_copy``, a factory) into float64, and lists the ops that still produced a lower one:
the oracle's record says which, if any, were not float64.

    with float64_throughout() as mode:
        loss = ...; loss.backward()
    mode.not_float64    # ["aten::..."], [] where every floating output was float64

MODE is stored with a reference's oracle step 0 (evidence/oracle_step0.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..evidence import step0
from ..evidence.oracle_step0 import MODE_KEY
from ..reference.record import RunRecord
from .seeding import usable_cpus

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
                    self.found.add(str(func._schema.name) if hasattr(func, "_schema") else str(func))
            return out

    with Float64Throughout() as watching:
        yield watching


def float64_step0(model: Any, cfg: dict[str, Any], vocab_size: int) -> tuple[float, dict[str, Any]]:
    """``model`` in float64 (its experts by the eager loop): the loss of step 0's whole global batch, backward
    done, every op in float64 (``float64_throughout``); and what the record keeps of the mode: its name and the
    ops that were not float64. Uses every core it may (usable_cpus): float64 on the GPU model is slow, and
    summation order barely matters here."""
    import torch

    from .data import token_source
    from .moe import in_float64

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

    from .models import blueprint, build_causal_lm

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
