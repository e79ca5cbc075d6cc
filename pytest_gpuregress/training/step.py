"""What every training scenario's step shares on a rank: this rank's tokens, and the next-token loss."""

from __future__ import annotations

from typing import Any

from .data import MarkovTokens
from .noise import apply_batch_order


def rank_tokens(data: MarkovTokens, step: int, ctx: Any, perturbation: str, device: Any) -> Any:
    """This rank's slice of the step's global batch, in the order a noise replica asks for, on ``device``."""
    import torch

    tokens = torch.from_numpy(data.rank_batch(step, ctx.rank, ctx.world_size))
    return apply_batch_order(tokens, perturbation).to(device)


def next_token_loss(model: Any, tokens: Any) -> Any:
    """Mean cross-entropy of predicting each token from the ones before it, in float32 whatever the compute dtype."""
    import torch

    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
