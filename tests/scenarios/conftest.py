"""What the lora scenario's in-process tests share: the tiny Llama's lora config at one rank, a process group of one
gloo rank, a RankContext, an injected fault undone after, a trained adapter on the tiny Llama, and one clean run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_gpuregress.fault_points import Wrapper, intercept
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.base import RankContext, Setup

from ..conftest import gloo_world_of_one

ONE_CPU_RANK = Setup(device_kind="cpu", backend="gloo", world_size=1)
# The module the lora faults act on by default (faults/lora.py target_module: layer 1, q_proj).
FAULTED_MODULE = "model.layers.1.self_attn.q_proj"


def tiny_lora_config(wrapper: str = "fsdp2", **changes: Any) -> dict[str, Any]:
    """The lora scenario's CPU config of the tiny Llama, made small: 3 steps of 2 sequences of 16 tokens, no op
    trace (a reference's business, not these tests')."""
    from pytest_gpuregress.scenarios.lora import ADAMW_OF_WRAPPER, SCENARIO

    config = {**SCENARIO.default_config(ONE_CPU_RANK), "wrapper": wrapper, "adamw": ADAMW_OF_WRAPPER[wrapper],
              "steps": 3, "global_batch": 2, "seq_len": 16, "op_trace": False}
    return {**config, **changes}


def rank_context(config: dict[str, Any], run_dir: Path) -> RankContext:
    """Rank 0 of a one-rank CPU world running ``config``, without the kernel inventory."""
    return RankContext(rank=0, world_size=1, local_rank=0, device_kind="cpu", backend="gloo", config=config,
                       run_dir=run_dir, profile=False)


@contextmanager
def injected(spec: str, ctx: Any | None = None) -> Iterator[Any]:
    """The fault ``spec`` installed as on rank 0 of a one-rank world (on ``ctx`` where given); yields its firing
    counter; undone on the way out."""
    from types import SimpleNamespace

    from pytest_gpuregress import faults

    ctx = ctx or SimpleNamespace(rank=0, world_size=1, device_kind="cpu", cleanup_hooks=[], step_hooks=[],
                                 teardown_hooks=[])
    (installed,) = faults.install_counted([spec], ctx)
    try:
        yield installed
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()
        ctx.cleanup_hooks.clear()


@contextmanager
def intercepting(point: str, wrapper: Wrapper) -> Iterator[None]:
    """A bug of a test's own at fault point ``point`` (what a fault kind would install), undone on the way out."""
    undo = intercept(point, wrapper)
    try:
        yield
    finally:
        undo()


@pytest.fixture(scope="module")
def tiny() -> dict[str, Any]:
    """The tiny Llama (rebuilt by ``base``), a trained-looking adapter for it (lora_B away from zero, so what the
    adapter adds shows), the config that wraps it and a fixed batch of 2 x 16 tokens."""
    import torch

    from pytest_gpuregress.scenarios.lora import DEFAULT_TARGETS, adapter, checks
    from pytest_gpuregress.training.models import blueprint, build_causal_lm

    cfg = {"model": "tiny-llama", "model_size": "cpu", "seed": 0, "lora_r": 8, "lora_alpha": 16,
           "target_modules": list(DEFAULT_TARGETS)}
    model_config = blueprint(cfg)
    base: Callable[[], Any] = lambda: build_causal_lm(model_config, seed=0)  # noqa: E731
    peft_model = adapter.wrap_with_lora(base(), cfg)
    rng = np.random.default_rng(0)
    trained = {name: (rng.standard_normal(tuple(p.shape)) * 0.05).astype(np.float32)
               for name, p in peft_model.named_parameters() if checks.is_adapter(name)}
    batch = torch.randint(0, model_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return {"base": base, "trained": trained, "cfg": cfg, "batch": batch}


@pytest.fixture(scope="session")
def clean_lora_run(tmp_path_factory: pytest.TempPathFactory) -> RunRecord:
    """The lora scenario's rank entry run once, clean, in this process: fully_shard at one rank, 3 steps."""
    from pytest_gpuregress.scenarios.lora import rank

    folder = tmp_path_factory.mktemp("clean-lora-run")
    with gloo_world_of_one(folder):
        return rank.run(rank_context(tiny_lora_config(), folder))
