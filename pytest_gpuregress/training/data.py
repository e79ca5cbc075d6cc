"""Deterministic, learnable token data that is identical on every platform.

A sparse Markov chain sampled from a counter-based hash of (seed, step, sample, position), so no library's
random stream is involved. A step's global batch is fixed and a rank takes a contiguous slice of it: the
world size changes who computes what, not what is computed. A user's token file (token_file.py) or a
factory's ids give the same interface: ``global_batch_at(step)`` and ``rank_batch(step, rank, world)``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadTokens
from .counter_rng import hash_words, unit_float
from .factory import factory_model
from .token_file import load_tokens


def rank_slice(batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's contiguous slice of a step's global batch."""
    if len(batch) % world_size:
        raise ValueError(f"global batch {len(batch)} is not divisible by world size {world_size}; "
                         "choose a world size that divides it or change the model's global_batch")
    per_rank = len(batch) // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


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


@dataclass
class TokenFileBatches:
    """Global batches of windows from a token stream (a user's file, a factory's ids): step s, sample i reads
    window ``s * global_batch + i``, wrapping around, so the global batch is fixed as with the synthetic data."""

    stream: np.ndarray
    vocab_size: int
    seq_len: int
    global_batch: int

    @property
    def windows(self) -> int:
        return max(1, (self.stream.size - 1) // self.seq_len)

    def global_batch_at(self, step: int) -> np.ndarray:
        """[global_batch, seq_len + 1] ids; consecutive windows overlap by one token (the next-token label)."""
        index = (step * self.global_batch + np.arange(self.global_batch)) % self.windows
        offsets = index[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]
        return self.stream[offsets % self.stream.size]

    def rank_batch(self, step: int, rank: int, world_size: int) -> np.ndarray:
        return rank_slice(self.global_batch_at(step), rank, world_size)


def open_tokens(described: dict[str, Any], vocab_size: int, seq_len: int, global_batch: int) -> TokenFileBatches:
    """On a rank: the batches of a config's file (or factory); refuses data changed since the session read it (or
    another file at that path on another node)."""
    if described.get("factory"):
        where: object = described["factory"]
        stream = factory_model(str(where)).tokens
        fix = "return the same token ids from every call of the factory"
    else:
        where = Path(described["file"])
        stream = load_tokens(where)
        fix = "keep the file unchanged during a run; on several nodes, give each the same file"
    if stream is None or hashlib.sha256(stream.tobytes()).hexdigest() != described["sha256"]:
        raise BadTokens(where, "changed since the session read it (its sha256 differs)", fix,
                        "--gpuregress-model" if described.get("factory") else "--gpuregress-tokens")
    return TokenFileBatches(stream, vocab_size, seq_len, global_batch)


def token_source(cfg: dict[str, Any], vocab_size: int) -> Any:
    """A training scenario's data: the config's token file (token_file.py), else the synthetic Markov chain."""
    if cfg.get("tokens"):
        return open_tokens(cfg["tokens"], vocab_size, int(cfg["seq_len"]), int(cfg["global_batch"]))
    return MarkovTokens(vocab_size=vocab_size, seq_len=int(cfg["seq_len"]), global_batch=int(cfg["global_batch"]),
                        seed=int(cfg["data_seed"]))
