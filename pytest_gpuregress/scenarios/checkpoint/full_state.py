"""Rank side: the full state dict gathered to one safetensors file, and reloaded into a freshly built model.

Saved as FSDP2 users save (each tied tensor once, as transformers does); reloaded with the stack's own
``safetensors.torch.load_model`` after the strict reader's check, so what is compared is what the stack made of
the file, not a copy of our own. Fault points: ``gather``, ``tensors_to_save``, ``stack_load``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CheckpointProblem, GpuRegressError
from ...fault_points import fault_point
from ...reference import atomic
from . import files, hooks, portable

TIED_METADATA = "gpuregress.tied"  # JSON: alias -> the name the tensor is stored under


@fault_point("checkpoint.gather")
def gather(model: Any) -> dict[str, Any]:
    """The whole state dict on rank 0 (CPU tensors), empty on the other ranks. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@fault_point("checkpoint.tensors_to_save")
def tensors_to_save(state: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """One entry per tied group, under its first name; every untied tensor as it is."""
    aliases = {name for group in groups for name in group[1:]}
    return {name: tensor for name, tensor in state.items() if name not in aliases}


def write(path: Path, tensors: dict[str, Any], groups: list[list[str]]) -> None:
    from safetensors.torch import save

    tied = {alias: group[0] for group in groups for alias in group[1:]}
    data = save({k: v.detach().contiguous() for k, v in tensors.items()},
                metadata={"format": "pt", TIED_METADATA: json.dumps(tied, sort_keys=True)})
    atomic.write_bytes(path, data)


def reload(path: Path, model_config: Any, label: str) -> Any:
    """A freshly built model loaded from the file by the stack; CheckpointProblem when the file does not fit the config."""
    model = portable.empty_model(model_config)
    portable.match(files.read(path), model, model_config, label)  # the strict reader first: errors naming the fix
    portable.poison(model)  # a tensor the stack's load skips then shows as NaN, not as its initial value
    stack_load(model, path)
    hooks.after_load(dict(model.state_dict(keep_vars=True)))
    return model


@fault_point("checkpoint.stack_load")
def stack_load(model: Any, path: Path) -> None:
    """``safetensors.torch.load_model(strict=True)``: the stack's loader, tied names stored once included (it
    matches them to the model's shared tensors itself, so what ``check_ties`` sees afterwards is its doing)."""
    import safetensors.torch  # looked up at call time: the stack's function, whatever wraps it

    try:
        safetensors.torch.load_model(model, str(path), strict=True)
    except RuntimeError as exc:
        raise CheckpointProblem(path, None, f"safetensors.torch.load_model(strict=True) refused it: "
                                f"{' '.join(str(exc).split())}", "save the checkpoint again") from None


def saved_arrays(path: Path) -> dict[str, np.ndarray]:
    """The written file as the stack reads it (``safetensors.torch.load_file``), as the bundle keeps it: each
    tensor under ``checkpoint/<name>``. The reference holds the stack's artifact, not our in-memory copy."""
    import safetensors.torch

    return {files.BUNDLE_PREFIX + name: np.array(tensor.numpy(), order="C")  # a copy: the folder goes away
            for name, tensor in safetensors.torch.load_file(str(path), device="cpu").items()}


def logits_of(model: Any, device: Any, vocab_size: int) -> np.ndarray:
    """Logits on the fixed batch; on an FSDP2 model every rank must call it (the forward all-gathers)."""
    import torch

    ids = torch.from_numpy(portable.fixed_batch(vocab_size)).to(device)
    with torch.no_grad():
        out = model(input_ids=ids).logits.detach().float().cpu().numpy()
    if hasattr(model, "reshard"):
        model.reshard()  # the root stays unsharded after a forward without backward; parameters must be DTensors again
    return out


def roundtrip(state: dict[str, Any], trained: dict[str, np.ndarray], trained_logits: np.ndarray, model_config: Any,
              label: str, folder: Path, device: Any) -> tuple[list[str], np.ndarray | None]:
    """Rank 0: write the gathered ``state``, check the file, reload it, check tensors, the tie and logits.

    Returns (findings, the reloaded model's logits or None when the reload failed)."""
    groups = portable.tie_groups(portable.empty_model(model_config))
    path = folder / "model.safetensors"
    write(path, tensors_to_save(state, groups), groups)
    try:
        findings = check_file(files.read(path), trained, groups)
    except GpuRegressError as exc:
        return [f"the saved file cannot be read: {exc}"], None
    try:
        model = reload(path, model_config, label)
    except GpuRegressError as exc:
        return findings + [f"reloading the saved file failed: {exc}"], None
    for name, expected in trained.items():
        got = portable.held(model, name, expected)
        if got.tobytes() != expected.tobytes():
            findings.append(f"{name} after reload: {portable.describe_difference(expected, got)}")
    findings += check_ties(model, groups)
    logits = logits_of(model.to(device), device, int(model_config.vocab_size))
    if logits.tobytes() != trained_logits.tobytes():
        findings.append(f"logits on the fixed batch: the reloaded model's are not bit-identical to the trained "
                        f"model's (largest difference {portable.deviation_between(logits, trained_logits):.3g} of the "
                        "largest logit)")
    return findings, logits


def check_file(saved: files.CheckpointFiles, trained: dict[str, np.ndarray], groups: list[list[str]]) -> list[str]:
    """The written file against the gathered tensors: every tie group once, whole, bit for bit."""
    return [finding for group in groups if (finding := _saved_group(saved, trained, group))]


def _saved_group(saved: files.CheckpointFiles, trained: dict[str, np.ndarray], group: list[str]) -> str | None:
    """What is wrong with one tie group in the written file: missing, a shard's shape, other bits; None if nothing."""
    present = [n for n in group if n in saved.tensors]
    if not present:
        tied = f" (tied: {' = '.join(group)}; none of these names is in the file)" if len(group) > 1 else ""
        return f"{group[0]} is missing from the saved file{tied}"
    name = present[0]
    got, expected = saved.tensors[name], trained[name]
    if got.shape != expected.shape:
        why = ""
        if got.ndim and got.shape[1:] == expected.shape[1:] and got.shape[0] < expected.shape[0]:
            why = ": the file holds one rank's shard, not the whole tensor"
        return f"{name} saved with shape {list(got.shape)}, the model's is {list(expected.shape)}{why}"
    if got.tobytes() != expected.tobytes():
        return f"{name} in the saved file: {portable.describe_difference(expected, got)}"
    return None


def check_ties(model: Any, groups: list[list[str]]) -> list[str]:
    """Each tied group is one tensor in the reloaded model: the same storage, not equal copies."""
    state = model.state_dict(keep_vars=True)
    findings = []
    for group in groups:  # a group of one name is one storage: never a finding
        storages = {state[name].data_ptr() for name in group}
        if len(storages) > 1:
            same = all(state[n].detach().cpu().numpy().tobytes() == state[group[0]].detach().cpu().numpy().tobytes()
                       for n in group)
            findings.append(f"the tie {' = '.join(group)} is lost after reload: {len(storages)} tensors "
                            f"({'equal copies' if same else 'with different values'}), not one storage under both names")
    return findings
