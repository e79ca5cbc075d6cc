"""What a test case exercises and a fault acts on: one vocabulary for both sides.

An activity is ``"name"`` or ``"name:detail"`` (``collective:all_reduce``); ``*`` as the detail means any.
Cases declare theirs (``Case.exercises``), fault kinds theirs (``FaultKind.acts_on``); faults/reach.py
computes from the two which fault reaches which case.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ANY = "*"

# Training, in the scenarios' own loops (training/loop.py)
STEP = "optimizer step"  # an optimizer and schedule step
FROM_STEP_0 = "steps from 0"  # its training starts at step 0 (a resume starts late: an early hang never happens)
CLIP = "clipping"  # gradient clipping that acts on a real share of the steps
FORWARD = "model forward"  # a transformers model's forward pass: linear layers, attention, activations
LINEAR_ALGEBRA = "linear algebra"  # nn.Linear and torch.matmul outside a model (consensus's battery)
LLAMA_FORWARD = "llama forward"  # the Llama family's forward code, as installed (transformers)
BF16_CAST = "bf16 cast"  # fp32 -> bf16 casts: training in bf16
TIED_CONFIG = "tied embeddings"  # a model whose config ties its embeddings, built by transformers
SYNTHETIC_TOKENS = "synthetic tokens"  # token batches drawn by training/data.py (numpy), not read from a token file
RANDOM_STREAMS = "random streams"  # a data pipeline that draws from Python's, numpy's and torch's generators
PEFT_LORA = "peft lora"  # peft's LoRA layers, as installed
ACCELERATE_BACKWARD = "accelerate backward"  # the loss's backward through accelerate's Accelerator.backward
ADAPTER_SAVE = "adapter save"  # a trained LoRA adapter saved and loaded
ADAPTER_SHARDS = "adapter shards"  # an adapter saved from shards (FSDP2): a slice can be lost


def adamw(implementation: str) -> str:
    """AdamW's ``fused``, ``foreach`` or ``single`` (tensor) implementation."""
    return f"adamw:{implementation}"


def collective(op: str = ANY) -> str:
    """A torch.distributed collective between ranks: ``all_reduce``, ``reduce_scatter`` ... (``*``: every one)."""
    return f"collective:{op}"


def bf16_reduction(op: str = ANY) -> str:
    """A bf16 SUM reduction in a collective (``all_reduce``, ``reduce_scatter``)."""
    return f"bf16 reduction:{op}"


# Number formats (scenarios/formats)
FP8_CODECS = "fp8 codecs"  # fp8/fp4 encode, decode, overflow and NaN behaviour, quantized round trips
BF16_READ_BACK = "bf16 loader"  # bf16 weights read back through the stack's loaders


def fp8_loader(path: str = ANY) -> str:
    """fp8 tensors read through one of the stack's loaders: ``safetensors``, ``safe_open``, ``torch_load``..."""
    return f"fp8 loader:{path}"


def e5m2_loader(path: str = ANY) -> str:
    """e5m2 tensors read through one of the stack's loaders."""
    return f"e5m2 loader:{path}"


# Checkpoints (scenarios/checkpoint, and the resume cases)
OPTIMIZER_STATE_LOAD = "optimizer state load"
FULL_STATE_DICT = "full state dict save"  # gathered from the shards of every rank
SHARDED_LOAD = "sharded load"  # a checkpoint's chunks read at another world size
TIED_SAVE = "tied weights save"  # a model whose embeddings are tied, saved and loaded
RESUME_RESTORE = "resume restore"  # weights, optimizer and generators restored to continue training
CHECKPOINT_READ = "checkpoint weights read"  # any checkpoint's weights read back


@dataclass(frozen=True)
class Exercises:
    """What one case runs; ``absent``: activity -> why it does not run it here (a CPU runs accelerate's DDP, so no
    adapter shard); ``summary``: what it runs, in words, when it runs little (why most faults do not reach it)."""

    does: frozenset[str]
    summary: str = ""
    absent: Mapping[str, str] = field(default_factory=dict)

    def __or__(self, more: Iterable[str]) -> Exercises:
        return Exercises(self.does | frozenset(more), self.summary, self.absent)


def exercises(*does: str, summary: str = "", absent: Mapping[str, str] | None = None) -> Exercises:
    return Exercises(frozenset(does), summary, dict(absent or {}))


def matches(acted: str, exercised: str) -> bool:
    """Whether a fault acting on ``acted`` acts in a case that runs ``exercised`` (``*`` matches any detail)."""
    acted_name, _, acted_detail = acted.partition(":")
    name, _, detail = exercised.partition(":")
    return acted_name == name and (acted_detail == detail or ANY in (acted_detail, detail))


def meets(acted: Iterable[str], does: Iterable[str]) -> bool:
    """Whether any activity a fault acts on is one the case runs."""
    runs = list(does)
    return any(matches(a, e) for a in acted for e in runs)


def reason_absent(acted: Iterable[str], case: Exercises) -> str:
    """Why ``case`` runs none of ``acted``: its own words for the first it lacks here, else its summary."""
    return next((why for a in acted for name, why in case.absent.items() if matches(a, name)), case.summary)
