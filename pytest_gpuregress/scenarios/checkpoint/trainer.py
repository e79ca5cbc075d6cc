"""Rank side: the model under FSDP2, AdamW with warm-up and cosine decay, and a data stream with a position.

The data pipeline is what a real training loop has, and it consumes every random generator a
checkpoint must restore: the rows of each global batch are shuffled (Python's ``random``), each
batch is cropped at a random offset (numpy), some input tokens are replaced (torch's CPU generator)
and some labels are dropped (torch's generator on the device). So a resumed run whose generators or
data position were not restored computes other numbers, not only other digests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...training.data import token_source
from ...training.schedule import lr_factor

IGNORE = -100  # cross_entropy's ignore_index: a dropped label


@dataclass
class StochasticBatches:
    """Global batches from a fixed token stream, read at ``position``; every rank draws the same random numbers."""

    source: Any  # training/data.py token_source: the synthetic chain or the user's token file
    config: dict[str, Any]
    position: int = 0

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
        replaced = torch.rand(inputs.shape) < float(self.config["token_dropout"])  # torch's CPU generator
        inputs[replaced] = torch.randint(0, vocab, inputs.shape)[replaced]
        inputs, labels = inputs.to(device), labels.to(device)
        dropped = torch.rand(labels.shape, device=device) < float(self.config["label_dropout"])  # the device's
        return inputs, labels.masked_fill(dropped, IGNORE)


@dataclass
class Trainer:
    model: Any
    optimizer: Any
    scheduler: Any
    data: StochasticBatches
    device: Any
    rank: int
    world_size: int
    names: list[str] = field(default_factory=list)

    @property
    def params(self) -> list[Any]:
        return list(self.optimizer.param_groups[0]["params"])

    def step(self) -> tuple[float, float]:
        """One optimizer step; returns (the loss averaged over ranks, the global gradient norm)."""
        import torch
        import torch.distributed as dist

        inputs, labels = self.data.next(self.rank, self.world_size, self.device)
        logits = self.model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=IGNORE)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, float(self.data.config["grad_clip"]))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = loss.detach().double()
        dist.all_reduce(total)
        return float(total) / self.world_size, float(norm.double())


def shard(model: Any) -> Any:
    """``fully_shard`` on every decoder layer and the root, fp32 throughout."""
    from torch.distributed.fsdp import fully_shard

    from ...training.models import decoder_layers

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def build(cfg: dict[str, Any], ctx: Any) -> Trainer:
    """A freshly initialised trainer of ``cfg``'s model at step 0, for ``cfg["steps"]`` steps in all."""
    import torch

    from ...training.models import blueprint, build_causal_lm

    model_config = blueprint(cfg)
    model = shard(build_causal_lm(model_config, seed=int(cfg["seed"])).to(torch.device(ctx.device)))
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW([p for _, p in named], lr=float(cfg["lr"]), betas=tuple(cfg["betas"]),
                                  eps=float(cfg["eps"]), weight_decay=float(cfg["weight_decay"]), foreach=False)
    steps = int(cfg["steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, steps, int(cfg["warmup_steps"]), float(cfg["min_lr_ratio"])))
    data = StochasticBatches(token_source(cfg, model_config.vocab_size), cfg)
    return Trainer(model, optimizer, scheduler, data, torch.device(ctx.device), ctx.rank, ctx.world_size,
                   [n for n, _ in named])


def train(trainer: Trainer, steps: range, ctx: Any) -> tuple[list[float], list[float]]:
    """Run ``steps`` (their numbers are only for progress reports); return (losses, gradient norms)."""
    losses: list[float] = []
    norms: list[float] = []
    for step in steps:
        loss, norm = trainer.step()
        losses.append(loss)
        norms.append(norm)
        ctx.step_done(step)
    return losses, norms
