"""A model that is not a transformers model, for ``--gpuregress-model my_models:tiny_mixer``.

Anything a factory returns works if it takes ``input_ids`` and returns logits (or an object with
``.logits``), says its ``vocab_size``, and names its repeated block in ``_no_split_modules``, the
class ``fully_shard`` wraps one by one. Its weights are re-initialised from the run's seed.
The factory may also return token ids to train on: ``return model, ids``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

VOCAB, WIDTH, LAYERS, CONTEXT = 128, 48, 2, 256


class MixerBlock(nn.Module):
    """Causal token mixing (a running mean of the positions so far), then a feed-forward layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix_norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.ff_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix_norm(x)
        positions = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        x = x + self.mix(h.cumsum(dim=1) / positions)
        return x + self.down(nn.functional.gelu(self.up(self.ff_norm(x))))


class TinyMixer(nn.Module):
    _no_split_modules = ["MixerBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = VOCAB
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        self.blocks = nn.ModuleList(MixerBlock(WIDTH) for _ in range(LAYERS))
        self.final_norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def tiny_mixer() -> nn.Module:
    return TinyMixer()


def tiny_mixer_with_tokens() -> tuple[nn.Module, np.ndarray]:
    """The model and a sample of its own data: a repeating pattern with a little noise, fixed by its seed."""
    rng = np.random.default_rng(7)
    pattern = np.tile(np.arange(0, VOCAB, 3), 200)
    noise = rng.integers(0, VOCAB, pattern.size)
    return TinyMixer(), np.where(rng.random(pattern.size) < 0.1, noise, pattern)
