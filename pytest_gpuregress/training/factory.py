"""A user's own model from a factory function: ``--gpuregress-model package.module:function``.

The factory takes no arguments and returns a ``torch.nn.Module``, or ``(module, token_ids)`` where
``token_ids`` is an integer array (numpy or torch, any shape) read as one stream like a
``--gpuregress-tokens`` file. The module must:
  - take ``input_ids`` (a [batch, seq] int64 tensor) as a keyword and return the logits
    ([batch, seq, vocab]), or an object with ``.logits`` (a transformers model does);
  - say its vocabulary size: ``module.config.vocab_size`` or ``module.vocab_size``;
  - name its repeated blocks in ``_no_split_modules`` (the transformers convention): ``fully_shard``
    wraps each of them.
Its weights are re-initialised from the seed as the shipped models' are (training/models.py), so its
own init code, and torch's random streams, cannot move the starting point. Its identity, stored with
references, is its structure: every parameter's name, shape and dtype, and its module classes.

The module is imported from the working directory (the session's, which ranks work in too), so a
``conftest.py`` neighbour or an installed package both work.
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

DEFAULT_STD = 0.02  # the initializer_range of the shipped configs


def is_factory(value: str) -> bool:
    """``package.module:function``, as opposed to a config file or a zoo name."""
    module, sep, function = value.partition(":")
    return bool(sep) and function.isidentifier() and all(p.isidentifier() for p in module.split("."))


def resolve(entry: str) -> Any:
    """The factory function ``entry`` names; BadModel naming it and the fix when it cannot be imported."""
    module_name, _, function_name = entry.partition(":")
    if os.getcwd() not in sys.path:  # where `python -m pytest` looks first; plain `pytest` does not
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any error while importing the user's module means "cannot import"
        raise BadModel(entry, f"cannot import {module_name} ({type(exc).__name__}: {exc})",
                       "make the module importable from the directory pytest runs in, or install its package") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise BadModel(entry, f"{module_name} has no function {function_name}",
                       "name a function that returns the model (package.module:function)")
    return factory


@dataclass(frozen=True)
class FactoryModel:
    """The model a factory builds, with what the training scenarios ask of a transformers config."""

    entry: str

    @property
    def name(self) -> str:
        return self.entry.rsplit(":", 1)[1]

    def _call(self, with_tokens: bool = False) -> tuple[Any, np.ndarray | None]:
        import torch

        try:
            made = resolve(self.entry)()
        except BadModel:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code: report it, naming the factory
            raise BadModel(self.entry, f"the factory raised {type(exc).__name__}: {exc}", "fix the factory") from None
        model, tokens = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
        if not isinstance(model, torch.nn.Module):
            raise BadModel(self.entry, f"returned {type(model).__name__}, not a torch.nn.Module",
                           "return the model, or (model, token ids)")
        if not with_tokens:
            return model, None
        if tokens is not None:
            tokens = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens)
            if tokens.dtype.kind not in "iu" or tokens.size == 0 or int(tokens.min()) < 0:
                raise BadModel(self.entry, f"returned token ids of dtype {tokens.dtype} and {tokens.size} elements",
                               "return non-negative integer token ids with the model")
            tokens = tokens.reshape(-1).astype(np.int64)
        return model, tokens

    def empty(self) -> Any:
        """The model as the factory makes it, fp32 on the CPU, its values to be overwritten (a checkpoint load).
        The factory's own random draws do not touch the caller's generators."""
        import torch

        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            model = self._call()[0].float()
        return _with_logits_output(model)

    def build(self, seed: int) -> Any:
        """A fresh model, initialised from ``seed`` as the shipped models are, fp32 on the CPU."""
        from .models import seed_parameters

        model = self.empty()
        seed_parameters(model, seed, DEFAULT_STD)
        return model

    @functools.cached_property
    def _facts(self) -> dict[str, Any]:
        """What the model is, from one call of the factory on the meta device (no memory for its weights)."""
        import torch

        from .models import decoder_layers

        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model, _ = self._call()
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or getattr(model, "vocab_size", None)
        if not isinstance(vocab, int) or vocab <= 0:
            raise BadModel(self.entry, "the model says no vocabulary size",
                           "give the module a vocab_size attribute (or a config with vocab_size)")
        try:
            layers = len(decoder_layers(model))
        except ValueError as exc:
            raise BadModel(self.entry, str(exc), "set _no_split_modules = ['YourBlock'] on the module's class") from None
        structure = [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
        classes = sorted({type(m).__name__ for m in model.modules()})
        return {"vocab_size": int(vocab), "layers": layers,
                "digest": hashlib.sha256(json.dumps([structure, classes]).encode()).hexdigest()[:12],
                "parameters": sum(p.numel() for p in model.parameters()),
                "inner": max((int(p.shape[-1]) for p in model.parameters() if p.ndim >= 2), default=1),
                "module_names": frozenset(n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n)}

    @functools.cached_property
    def tokens(self) -> np.ndarray | None:
        """The token ids the factory returns with its model (one stream), or None: from a call on the CPU."""
        import torch

        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            return self._call(with_tokens=True)[1]

    # What the scenarios read of a transformers config; the same names, so one code path serves both.
    @property
    def vocab_size(self) -> int:
        return int(self._facts["vocab_size"])

    @property
    def num_hidden_layers(self) -> int:
        return int(self._facts["layers"])

    @property
    def hidden_size(self) -> int:
        """The longest inner product a weight matrix takes part in (its last dimension): what the float32
        error bounds (checkpoint/portable.py) read a config's hidden and intermediate sizes for."""
        return int(self._facts["inner"])

    @property
    def architectures(self) -> list[str]:
        return [self.entry]

    dtype = None  # the factory's model is trained in fp32 like every other

    @property
    def digest(self) -> str:
        return str(self._facts["digest"])

    @property
    def parameters(self) -> int:
        return int(self._facts["parameters"])

    @property
    def module_names(self) -> frozenset[str]:
        return frozenset(self._facts["module_names"])


def factory_model(entry: str) -> FactoryModel:
    """One FactoryModel per entry and working directory (a pooled rank serves sessions from several): its
    facts are computed once."""
    return _factory_model(entry, os.getcwd())


@functools.lru_cache(maxsize=16)
def _factory_model(entry: str, cwd: str) -> FactoryModel:
    return FactoryModel(entry)


def _with_logits_output(model: Any) -> Any:
    """Make a module that returns a logits tensor return ``CausalLMOutput(logits=...)``, as the scenarios expect.

    A forward hook, not a wrapper module, so parameter names stay the factory's; transformers' output
    classes are pytrees, so FSDP2 still finds the tensor inside to hook its backward."""
    from transformers.modeling_outputs import CausalLMOutput

    def to_output(module: Any, args: Any, output: Any) -> Any:
        return CausalLMOutput(logits=output) if not hasattr(output, "logits") else output

    model.register_forward_hook(to_output)
    return model
