"""What every training scenario's step shares on a rank: this rank's tokens, and the next-token loss.

With ``emulate_world`` one rank runs each of N ranks' micro-batches in its own forward, so every GEMM
sees the shapes it sees on N ranks (kernels are picked by shape) and only communication differs.
"""

from __future__ import annotations

from typing import Any

from .data import MarkovTokens
from .noise import apply_batch_order

EMULATE_WORLD = "emulate_world"  # config key: the world a one-rank run stands in for
BATCH_DIGEST_BITS = 44  # a rank's batch digest: summed over up to 512 ranks, still exact in a float64


def rank_tokens(data: MarkovTokens, step: int, ctx: Any, perturbation: str, device: Any) -> Any:
    """This rank's slice of the step's global batch on ``device``, in a noise replica's order; its digest goes to
    ``ctx.batch_digest`` (training/loop.py)."""
    tokens = _tokens(data, step, ctx.rank, ctx.world_size, perturbation, device)
    ctx.batch_digest = batch_digest(tokens)
    return tokens


def batch_digest(tokens: Any) -> float:
    """The bits of a token batch as a number exact in float64 (tensor_digest's hash, cut to BATCH_DIGEST_BITS)."""
    from ..evidence.tensor_digest import digest

    return float(digest(tokens)[3] & ((1 << BATCH_DIGEST_BITS) - 1))


def _tokens(data: MarkovTokens, step: int, rank: int, world_size: int, perturbation: str, device: Any) -> Any:
    import torch

    tokens = torch.from_numpy(data.rank_batch(step, rank, world_size))
    return apply_batch_order(tokens, perturbation).to(device)


def step_loss(model: Any, data: MarkovTokens, step: int, ctx: Any, perturbation: str, device: Any) -> Any:
    """This rank's loss for ``step``; on a rank standing in for ``emulate_world`` ranks, the mean of their losses."""
    import torch

    emulated = int(ctx.config.get(EMULATE_WORLD, 0) or 0)
    if ctx.world_size != 1 or emulated <= 1:
        return next_token_loss(model, rank_tokens(data, step, ctx, perturbation, device))
    losses = [next_token_loss(model, _tokens(data, step, rank, emulated, perturbation, device)) for rank in range(emulated)]
    return torch.stack(losses).mean()  # the gradients FSDP2's reduce-scatter averages over the ranks


def next_token_loss(model: Any, tokens: Any) -> Any:
    """Mean cross-entropy of predicting each token from the ones before it, in float32 whatever the compute dtype."""
    import torch

    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
