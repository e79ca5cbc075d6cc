"""Rank side: the model under FSDP2, AdamW with warm-up and cosine decay, and a data stream with a position.

The data pipeline consumes every generator a checkpoint must restore (Python, numpy, torch CPU and device;
docs/checkpoint.md), so a resume that misses one computes other numbers, not only other digests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ...evidence.data_change import BATCH_DIGEST, stream_series
from ...training import loop
from ...training.data import token_source
from ...training.loop import TrainStep, clip_gradients
from ...training.models import build_causal_lm
from ...training.step import batch_digest
from ..shared.trainer import FsdpTrainer, TrainingSpec

IGNORE = -100  # cross_entropy's ignore_index: a dropped label


@dataclass
class StochasticBatches:
    """Global batches from a fixed token stream, read at ``position``; every rank draws the same random numbers."""

    source: Any  # training/data.py token_source: the synthetic chain or the user's token file
    config: dict[str, Any]
    position: int = 0
    # Per batch drawn: what each random stream and the token source gave (evidence/data_change.py's STREAMS),
    # as digests, so a run on other data can name the stream that moved.
    streams: list[dict[str, float]] = field(default_factory=list)

    def next(self, rank: int, world_size: int, device: Any) -> tuple[Any, Any]:
        """This rank's (input ids, labels) for the next global batch, on ``device``; advances the position."""
        import torch

        tokens = self.source.global_batch_at(self.position)
        self.position += 1
        order = random.sample(range(len(tokens)), len(tokens))  # Python's generator: the data order
        crop = int(self.config["max_crop"])
        offset = int(np.random.randint(0, crop + 1))  # numpy's generator: where the window starts
        window = tokens[order][:, offset : offset + tokens.shape[1] - crop]
        mine = torch.from_numpy(np.array_split(window, world_size)[rank])
        inputs, labels = mine[:, :-1].clone(), mine[:, 1:].clone()
        vocab = self.source.vocab_size
        draws = torch.rand(inputs.shape)  # torch's CPU generator: which input tokens are replaced, and by what
        substitutes = torch.randint(0, vocab, inputs.shape)
        replaced = draws < float(self.config["token_dropout"])
        inputs[replaced] = substitutes[replaced]
        inputs, labels = inputs.to(device), labels.to(device)
        label_draws = torch.rand(labels.shape, device=device)  # the device's generator: which labels are dropped
        self.streams.append({"tokens": batch_digest(torch.from_numpy(np.ascontiguousarray(tokens))),
                             "python": batch_digest(torch.tensor(order)), "numpy": float(offset),
                             "torch_cpu": batch_digest(torch.cat([draws.view(torch.int32).reshape(-1),
                                                                  substitutes.reshape(-1).to(torch.int32)])),
                             "device": batch_digest(label_draws)})
        return inputs, labels.masked_fill(label_draws < float(self.config["label_dropout"]), IGNORE)


@dataclass
class Trainer(FsdpTrainer):
    """The shared FSDP2 trainer (shared/trainer.py) over ``StochasticBatches``, with this scenario's step."""

    def loss(self, ctx: Any) -> Any:
        """This rank's loss on the next global batch; advances the data position. The batch's digest goes to
        ``ctx.batch_digest`` for the step's figures (training/loop.py): the series the reference compares."""
        import torch

        inputs, labels = self.data.next(self.rank, self.world_size, self.device)
        ctx.batch_digest = batch_digest(torch.cat([inputs.reshape(-1), labels.reshape(-1)]))
        logits = self.model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=IGNORE)

    def step(self, ctx: Any, batch_of: Any = int, **extra: Any) -> TrainStep:
        """The shared training step (training/loop.py) over this trainer: every parameter clipped, none tracked; the
        batch is the data's next, whatever the step's number."""
        max_norm = float(self.data.config["grad_clip"])
        return TrainStep(loss=lambda _step: self.loss(ctx), optimization=self.optimization,
                         clip=lambda: clip_gradients(self.params, max_norm), **extra)


# No mixed precision: fp32 throughout, on every platform.
SPEC = TrainingSpec(lambda ctx, cfg, model_config: build_causal_lm(model_config, seed=int(cfg["seed"])),
                    mp_policy=lambda _cfg: None,
                    data=lambda cfg, vocab: StochasticBatches(token_source(cfg, vocab), cfg), trainer=Trainer)


def build(cfg: dict[str, Any], ctx: Any) -> Trainer:
    """A freshly initialised trainer of ``cfg``'s model at step 0, for ``cfg["steps"]`` steps in all."""
    return cast(Trainer, SPEC.build(ctx, cfg))


def train(trainer: Trainer, steps: range, ctx: Any) -> loop.Curves:
    """Run ``steps`` (their numbers are only for progress reports); return their curves. ``ctx.step_done`` gets the
    step numbers only (progress lines, injected step faults): fail-fast does not stop a checkpoint run."""
    return loop.train(ctx, trainer.step(ctx), steps, report_metrics=False, stop_when_told=False)


def data_series(trainer: Trainer, *parts: loop.Curves) -> dict[str, list[float]]:
    """The record's series of what the run trained on: the global batches' digests (every rank's, summed) and,
    per random stream, this rank's draws (every rank draws the same numbers), over the curves of ``parts``."""
    digests = [d for part in parts for d in part.batch_digests]
    out = {BATCH_DIGEST: [float(d) for d in digests]} if digests and None not in digests else {}
    return out | stream_series(trainer.data.streams)
