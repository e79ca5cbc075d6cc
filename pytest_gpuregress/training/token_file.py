"""A user's own token sample (``--gpuregress-tokens FILE``) in place of the synthetic data: read, checked, described.

A ``.npy`` or ``.safetensors`` array of token ids read as one stream (data.py ``TokenFileBatches`` cuts its
windows). Nothing is unpickled.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BadTokens
from .models import blueprint

TENSOR_NAMES = ("input_ids", "tokens")


def load_tokens(path: Path) -> np.ndarray:
    """The file's token ids as one int64 stream; BadTokens names the file and the fix."""
    if not path.is_file():
        raise BadTokens(path, "no such file", "pass the path of a .npy or .safetensors file of token ids")
    suffix = path.suffix.lower()
    read = _READERS.get(suffix)
    if read is None:
        raise BadTokens(path, f"unknown file type {suffix or '(none)'!r}",
                        "save the ids with numpy.save (.npy) or safetensors (.safetensors)")
    try:
        values = read(path)
    except (ValueError, OSError) as exc:
        raise BadTokens(path, f"not a readable {suffix} file ({str(exc).splitlines()[0]})",
                        "write it again with numpy.save or safetensors.numpy.save_file") from None
    if not isinstance(values, np.ndarray):  # an .npz archive under an .npy name
        raise BadTokens(path, "is an archive of several arrays, not one array",
                        "save the token ids alone with numpy.save, or as safetensors")
    if values.dtype.kind not in "iu":
        raise BadTokens(path, f"holds {values.dtype}, not integer token ids",
                        "save the token ids as an integer array (int32 or int64)")
    stream = values.reshape(-1).astype(np.int64)
    if stream.size and int(stream.min()) < 0:
        raise BadTokens(path, f"holds a negative id ({int(stream.min())})", "token ids start at 0")
    return stream


def _safetensors_tokens(path: Path) -> np.ndarray:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except SafetensorError as exc:
        raise ValueError(str(exc)) from None
    if len(tensors) == 1:
        return next(iter(tensors.values()))
    for name in TENSOR_NAMES:
        if name in tensors:
            return tensors[name]
    raise BadTokens(path, f"holds {len(tensors)} tensors ({', '.join(sorted(tensors))}) and none is named "
                          f"{' or '.join(TENSOR_NAMES)}", "name the token ids input_ids, or save only them")


_READERS = {".npy": functools.partial(np.load, allow_pickle=False), ".safetensors": _safetensors_tokens}


@functools.lru_cache(maxsize=8)  # every case and launch asks for its config: read and hash the file once
def describe(path: Path, vocab_size: int, seq_len: int, whose: str = "the model") -> dict[str, Any]:
    """What a scenario's config keeps of the file: ``sha256`` and ``count`` (its identity), and ``file``, where this
    machine finds it (a copy at another path is not foreign)."""
    return {"file": str(path.resolve()), **identity(load_tokens(path), vocab_size, seq_len, path, whose=whose)}


def describe_for(cfg: dict[str, Any], tokens: Path | None) -> dict[str, Any] | None:
    """The ``tokens`` entry of a training config, checked against its model's vocabulary: the user's file
    (--gpuregress-tokens), else the ids a factory model returns, else None (the synthetic data)."""
    if tokens is None and not cfg.get("model_factory"):
        return None
    model = blueprint(cfg)
    vocab, seq_len = int(model.vocab_size), int(cfg["seq_len"])  # a config's vocab_size is its class default too
    if tokens is not None:  # several models may read one file: a refusal names whose vocabulary it missed
        return describe(tokens, vocab, seq_len, whose=f"model {cfg.get('model')!r}")

    own, entry = model.tokens, str(cfg["model_factory"])  # the ids a model factory returns (training/factory.py)
    return None if own is None else {"factory": entry, **identity(own, vocab, seq_len, entry, option="--gpuregress-model")}


def identity(stream: np.ndarray, vocab_size: int, seq_len: int, where: object,
             option: str = "--gpuregress-tokens", whose: str = "the model") -> dict[str, Any]:
    """The stream's hash and size, once it is checked to hold a sequence and only ids of the vocabulary."""
    if stream.size < seq_len + 1:
        raise BadTokens(where, f"holds {stream.size} tokens, fewer than one sequence of {seq_len + 1}",
                        "use a longer sample, or a shorter --gpuregress-steps/seq_len", option)
    largest = int(stream.max())
    if largest >= vocab_size:
        raise BadTokens(where, f"holds id {largest}, outside the vocabulary of {vocab_size} of {whose}",
                        f"use ids below {vocab_size}, the vocab_size of the model the scenario trains", option)
    return {"sha256": hashlib.sha256(stream.tobytes()).hexdigest(), "count": int(stream.size)}
