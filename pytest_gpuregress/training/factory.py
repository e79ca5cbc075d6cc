"""A user's own model from a factory function: ``--gpuregress-model package.module:function``.

The factory returns a ``torch.nn.Module`` or ``(module, token_ids)``; what the module must provide is
in docs/own-models.md. Its weights are re-seeded like the shipped models', and its identity is its
structure (parameter names, shapes, dtypes and module classes). Imported from the working directory.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BadModel
from .fsdp2 import decoder_layers
from .meta_build import without_init
from .projections import survey
from .seeding import seed_parameters

DEFAULT_STD = 0.02  # the initializer_range of the shipped configs


def is_factory(value: str) -> bool:
    """``package.module:function``, as opposed to a config file or a zoo name."""
    module, sep, function = value.partition(":")
    return bool(sep) and function.isidentifier() and all(p.isidentifier() for p in module.split("."))


def resolve(entry: str) -> Any:
    """The factory function ``entry`` names; BadModel naming it and the fix when it cannot be imported."""
    module_name, _, function_name = entry.partition(":")
    added = os.getcwd() not in sys.path  # where `python -m pytest` looks first; plain `pytest` does not
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any error while importing the user's module means "cannot import"
        raise BadModel(entry, f"cannot import {module_name} ({type(exc).__name__}: {exc})",
                       "make the module importable from the directory pytest runs in, or install its package") from None
    finally:
        if added:  # only for this import: the working directory must not shadow installed packages later
            sys.path.remove(os.getcwd())
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise BadModel(entry, f"{module_name} has no function {function_name}",
                       "name a function that returns the model (package.module:function)")
    return factory


@dataclass(frozen=True)
class Facts:
    """What a factory's model is (one sizing call): the fields of a transformers config the scenarios read, and
    its identity."""

    vocab_size: int
    num_hidden_layers: int
    hidden_size: int  # the longest inner product of a weight matrix (its last dim), for checkpoint/portable.py's bounds
    returns_tokens: bool
    digest: str  # of its structure: parameter names, shapes, dtypes and module classes
    parameters: int
    module_names: frozenset[str]
    projections: Any  # a BlockProjections (training/projections.py): the LoRA targets


def _fact(name: str) -> Any:
    """A read-only attribute of a FactoryModel: one of its ``Facts`` (computed once)."""
    return property(lambda self: getattr(self._facts, name))


@dataclass(frozen=True)
class FactoryModel:
    """The model a factory builds, with what the training scenarios ask of a transformers config."""

    entry: str

    @property
    def name(self) -> str:
        return self.entry.rsplit(":", 1)[1]

    def _call(self, device: str) -> tuple[Any, Any]:
        """(module, what came with it or None) from one factory call on ``device``, torch's generators seeded and
        restored after: its draws repeat and touch no caller's stream."""
        import torch

        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(0)
            try:
                made = resolve(self.entry)()
            except BadModel:
                raise
            except Exception as exc:  # noqa: BLE001 - the user's code: report it, naming the factory
                on = " (called on the meta device, to size the model)" if device == "meta" else ""
                raise BadModel(self.entry, f"the factory raised {type(exc).__name__}{on}: {exc}", "fix the factory") from None
        model, extra = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
        if not isinstance(model, torch.nn.Module):
            raise BadModel(self.entry, f"returned {type(model).__name__}, not a torch.nn.Module",
                           "return the model, or (model, token ids)")
        return model, extra

    def empty(self) -> Any:
        """The model as the factory makes it, fp32 on the CPU, its values to be overwritten (a checkpoint load)."""
        return _with_logits_output(self._call("cpu")[0].float())

    def build(self, seed: int) -> Any:
        """A fresh fp32 CPU model seeded as the shipped ones (std: its ``config.initializer_range``, else 0.02);
        its own init runs on meta parameters where the factory allows (meta_build.py)."""
        model, _ = without_init(self.empty)
        std = getattr(getattr(model, "config", None), "initializer_range", None)
        seed_parameters(model, seed, float(std) if isinstance(std, (int, float)) else DEFAULT_STD)
        return model

    def _sizing_call(self) -> tuple[Any, Any]:
        """One factory call on the meta device (no memory for weights), or on the CPU where it cannot run there."""
        try:
            return self._call("meta")
        except BadModel as exc:
            if "meta device" not in str(exc):
                raise
            return self._call("cpu")

    @functools.cached_property
    def _facts(self) -> Facts:
        """What the model is, from one sizing call of the factory; BadModel where the scenarios cannot train it."""
        model, extra = self._sizing_call()
        vocab = self._vocab_size(model)
        try:
            layers = len(decoder_layers(model))
        except ValueError as exc:
            raise BadModel(self.entry, str(exc), "set _no_split_modules = ['YourBlock'] on the module's class") from None
        self._check_trainable(model)
        structure = [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
        classes = sorted({type(m).__name__ for m in model.modules()})
        return Facts(vocab_size=vocab, num_hidden_layers=layers,
                     hidden_size=max((int(p.shape[-1]) for p in model.parameters() if p.ndim >= 2), default=1),
                     returns_tokens=extra is not None,
                     digest=hashlib.sha256(json.dumps([structure, classes]).encode()).hexdigest()[:12],
                     parameters=sum(p.numel() for p in model.parameters()),
                     module_names=frozenset(n for n, _ in model.named_modules() if n), projections=survey(model))

    def _vocab_size(self, model: Any) -> int:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or getattr(model, "vocab_size", None)
        if not isinstance(vocab, int) or vocab <= 0:
            raise BadModel(self.entry, "the model says no vocabulary size",
                           "give the module a vocab_size attribute (or a config with vocab_size)")
        return vocab

    def _check_trainable(self, model: Any) -> None:
        """BadModel for what the scenarios cannot train and round-trip: frozen parameters, persistent buffers."""
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            raise BadModel(self.entry, f"has parameters that do not train ({', '.join(frozen[:3])})",
                           "return the model with every parameter trainable: the scenarios train the whole model")
        buffers = sorted(set(model.state_dict()) - {n for n, _ in model.named_parameters()})
        if buffers:  # the checkpoint round trip saves and compares parameters
            raise BadModel(self.entry, f"has persistent buffers ({', '.join(buffers[:3])})",
                           "register them with persistent=False: they are rebuilt by the model's code, "
                           "as transformers models do")

    @functools.cached_property
    def tokens(self) -> np.ndarray | None:
        """The token ids the factory returns with its model (one int64 stream, from a CPU call), or None."""
        import torch

        if not self._facts.returns_tokens:
            return None
        ids = self._call("cpu")[1]
        try:
            values = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids)
        except (TypeError, ValueError) as exc:  # a bf16 tensor, ragged lists
            raise BadModel(self.entry, f"returned token ids numpy cannot read ({exc})",
                           "return an integer numpy array or tensor of token ids with the model") from None
        if values.dtype.kind not in "iu" or values.size == 0 or int(values.min()) < 0:
            raise BadModel(self.entry, f"returned token ids of dtype {values.dtype} and {values.size} elements",
                           "return non-negative integer token ids with the model")
        return values.reshape(-1).astype(np.int64)

    # What the scenarios read of a transformers config (Facts says what each is).
    vocab_size = _fact("vocab_size")
    num_hidden_layers = _fact("num_hidden_layers")
    hidden_size = _fact("hidden_size")
    dtype = None  # the factory's model is trained in fp32 like every other

    @property
    def architectures(self) -> list[str]:
        return [self.entry]

    digest = _fact("digest")
    parameters = _fact("parameters")
    module_names = _fact("module_names")
    projections = _fact("projections")


def factory_model(entry: str) -> FactoryModel:
    """One FactoryModel (its facts computed once) per entry and working directory: a pooled rank serves several."""
    return _factory_model(entry, os.getcwd())


@functools.lru_cache(maxsize=16)
def _factory_model(entry: str, cwd: str) -> FactoryModel:
    return FactoryModel(entry)


def _with_logits_output(model: Any) -> Any:
    """Make a module that returns logits return ``CausalLMOutput(logits=...)``: a forward hook, so parameter names
    stay the factory's; the output class is a pytree, so FSDP2 still hooks the tensor's backward."""
    from transformers.modeling_outputs import CausalLMOutput

    def to_output(module: Any, args: Any, output: Any) -> Any:
        return CausalLMOutput(logits=output) if not hasattr(output, "logits") else output

    model.register_forward_hook(to_output)
    return model
