"""Deterministic, learnable token data that is identical on every platform.

A sparse Markov chain sampled from a counter-based hash of (seed, step, sample, position), so no library's
random stream is involved. A step's global batch is fixed and a rank takes a contiguous slice of it: the
world size changes who computes what, not what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .counter_rng import hash_words, unit_float
from .slicing import rank_slice


@dataclass(frozen=True)
class MarkovTokens:
    """Sequences from a fixed sparse Markov chain; learnable well below ln(vocab)."""

    vocab_size: int
    seq_len: int
    global_batch: int
    seed: int = 1234
    branching: int = 4  # successors per token
    # probability mass of successor k; the chain's entropy is that of this distribution
    weights: tuple[float, ...] = (0.7, 0.15, 0.1, 0.05)

    def successors(self) -> np.ndarray:
        """[vocab, branching] table of successor tokens."""
        tok = np.arange(self.vocab_size, dtype=np.uint64)[:, None]
        k = np.arange(self.branching, dtype=np.uint64)[None, :]
        return (hash_words(self.seed, 1, tok, k) % np.uint64(self.vocab_size)).astype(np.int64)

    def global_batch_at(self, step: int) -> np.ndarray:
        """[global_batch, seq_len + 1] int64 tokens for ``step`` (inputs and shifted labels)."""
        table = self.successors()
        cdf = np.cumsum(np.asarray(self.weights[: self.branching], dtype=np.float64))
        cdf /= cdf[-1]
        sample = np.arange(self.global_batch, dtype=np.uint64)
        out = np.empty((self.global_batch, self.seq_len + 1), dtype=np.int64)
        out[:, 0] = (hash_words(self.seed, 2, step, sample) % np.uint64(self.vocab_size)).astype(np.int64)
        for pos in range(1, self.seq_len + 1):
            u = unit_float(hash_words(self.seed, 3, step, sample, pos))
            choice = np.searchsorted(cdf, u, side="right").clip(max=self.branching - 1)
            out[:, pos] = table[out[:, pos - 1], choice]
        return out

    def rank_batch(self, step: int, rank: int, world_size: int) -> np.ndarray:
        return rank_slice(self.global_batch_at(step), rank, world_size)

    def entropy_floor(self) -> float:
        """The lowest achievable mean cross-entropy (nats): a learnable target well below ln(V)."""
        w = np.asarray(self.weights[: self.branching], dtype=np.float64)
        w /= w.sum()
        return float(-(w * np.log(w)).sum())


def token_source(cfg: dict[str, Any], vocab_size: int) -> Any:
    """A training scenario's data: the user's token file where the config names one (training/token_file.py),
    else the synthetic Markov chain. Either has ``global_batch_at(step)`` and ``rank_batch(step, rank, world)``."""
    if cfg.get("tokens"):
        from .token_file import open_tokens

        return open_tokens(cfg["tokens"], vocab_size, int(cfg["seq_len"]), int(cfg["global_batch"]))
    return MarkovTokens(vocab_size=vocab_size, seq_len=int(cfg["seq_len"]), global_batch=int(cfg["global_batch"]),
                        seed=int(cfg["data_seed"]))
