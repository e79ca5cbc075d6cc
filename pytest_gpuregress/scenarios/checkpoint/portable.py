"""Does a checkpoint mean the same on this machine? Load it strictly, then logits and checksums. Rank side and CLI.

``evaluate`` checks the file with the strict reader, loads it the stack's way and reports per-tensor checksums
(exact everywhere: loading is a copy) and float32 logits on ``fixed_batch`` against float64. Two machines agree
when every checksum is equal and their logits differ by at most ``2 x logits_bound`` (docs/checkpoint.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from ...comparison.bounds import step0_bound
from ...errors import CheckpointProblem
from . import hooks
from .files import TORCH_NAMES, CheckpointFiles

BATCH = (2, 16)  # rows x tokens of the fixed batch


def fixed_batch(vocab_size: int, rows: int = BATCH[0], length: int = BATCH[1]) -> np.ndarray:
    """Token ids that depend on nothing but the vocabulary size: the same batch on every machine."""
    b, t = np.meshgrid(np.arange(rows), np.arange(length), indexing="ij")
    return ((b * 31 + t * 7 + 3) % vocab_size).astype(np.int64)


def logits_bound(model_config: Any, length: int = BATCH[1]) -> float:
    """How far float32 logits may be from float64 ones, relative to the largest: u sqrt(n) (L + 1), triage's bound
    (comparison/bounds.py): u = 2^-24, n the forward's longest inner product, L + 1 the layers plus the head. Two
    machines each within it of float64 differ by at most twice it."""
    n = max(int(getattr(model_config, "intermediate_size", 0) or 0), int(model_config.hidden_size), length)
    return step0_bound("fp32", n, int(model_config.num_hidden_layers))


def sha256(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def checksum(values: np.ndarray) -> dict[str, Any]:
    """sha256 of the bytes (the exact check) and float64 sums (for people; summation order may vary)."""
    as64 = values.astype(np.float64)
    return {"sha256": sha256(values), "sum": float(as64.sum()), "abs_sum": float(np.abs(as64).sum()),
            "shape": list(values.shape), "dtype": str(values.dtype)}


# --- the checkpoint against the model its config builds ---------------------------------------------


def empty_model(model_config: Any) -> Any:
    """The model ``model_config`` builds, fp32 on the CPU, to be overwritten by a load. Its throwaway
    initial values do not touch the caller's random generators (a training run may go on after it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ...training.factory import FactoryModel

    if isinstance(model_config, FactoryModel):  # a user's factory model (--gpuregress-model pkg.mod:function)
        return model_config.empty().eval()
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        return AutoModelForCausalLM.from_config(model_config).eval()


def tie_groups(model: Any) -> list[list[str]]:
    """Names of the state dict that share one tensor (tied weights), each group in state-dict order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(tensor.data_ptr(), []).append(name)
    return list(groups.values())


def config_dtype(model_config: Any) -> str | None:
    """The dtype the config declares for its weights ("bfloat16"), or None when it declares none."""
    value = getattr(model_config, "dtype", None)
    if value is None:  # transformers before 4.56 keeps it as torch_dtype (a deprecated alias since)
        value = vars(model_config).get("torch_dtype")
    return None if value is None else str(value).replace("torch.", "")


def _examples(names: list[str], count: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:count])
    return shown + (f" and {len(names) - count} more" if len(names) > count else "")


def match(ckpt: CheckpointFiles, model: Any, model_config: Any, config_label: str) -> dict[str, np.ndarray]:
    """Each tie group's tensor from the checkpoint, keyed by the group's first name; CheckpointProblem
    naming the file and the fix for a missing key, another architecture, a shape or dtype mismatch."""
    groups = tie_groups(model)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    _check_names(ckpt, groups, expected, model, model_config, config_label)
    declared = config_dtype(model_config)
    return {group[0]: _group_tensor(ckpt, group, expected, declared, config_label) for group in groups}


def _check_names(ckpt: CheckpointFiles, groups: list[list[str]], expected: dict[str, tuple[int, ...]], model: Any,
                 model_config: Any, config_label: str) -> None:
    """CheckpointProblem where the file's names are not the model's: another architecture, a missing tensor (tie
    group) or tensors the model does not have."""
    unexpected = sorted(set(ckpt.tensors) - set(expected))
    missing = [g for g in groups if not any(n in ckpt.tensors for n in g)]
    architecture = getattr(model_config, "architectures", None) or [type(model).__name__]
    if unexpected and len(missing) * 2 >= len(groups):
        raise CheckpointProblem(ckpt.path, None, f"a checkpoint for another architecture: {len(missing)} of the "
                                f"{len(groups)} tensors {config_label} builds ({architecture[0]}) are missing and "
                                f"{len(unexpected)} of its tensors are unknown to it (it has {_examples(unexpected)}; "
                                f"the config expects {_examples([g[0] for g in missing])})",
                                "pass the config.json the checkpoint was saved with (--config)")
    if missing:
        _missing(ckpt, missing, len(groups), config_label)
    if unexpected:
        raise CheckpointProblem(ckpt.file_of(unexpected[0]), unexpected[0], f"{len(unexpected)} tensors that the model "
                                f"{config_label} builds does not have ({_examples(unexpected)})",
                                "pass the config.json the checkpoint was saved with (--config)")


def _missing(ckpt: CheckpointFiles, missing: list[list[str]], groups: int, config_label: str) -> NoReturn:
    first = missing[0]
    tied = f" (tied: {' = '.join(first)}; the file holds none of these names)" if len(first) > 1 else ""
    raise CheckpointProblem(ckpt.path, first[0], f"missing: {config_label} builds a model with this tensor"
                            f"{tied}; {len(missing)} of {groups} tensors are missing "
                            f"({_examples([g[0] for g in missing])})",
                            "save the checkpoint again with every tensor (a tied weight must be stored under one "
                            "of its names), or pass the config it was saved with")


def _group_tensor(ckpt: CheckpointFiles, group: list[str], expected: dict[str, tuple[int, ...]], declared: Any,
                  config_label: str) -> np.ndarray:
    """The tensor one tie group reads: of the expected shape, a float dtype the config declares, and equal under
    every name of the group the file holds."""
    present = [n for n in group if n in ckpt.tensors]
    name = present[0]
    values, tag = ckpt.tensors[name], ckpt.tags[name]
    if tuple(values.shape) != expected[name]:
        wrong = sum(1 for n in ckpt.tensors if tuple(ckpt.tensors[n].shape) != expected.get(n))
        raise CheckpointProblem(ckpt.file_of(name), name, f"shape {list(values.shape)}, but {config_label} builds "
                                f"{list(expected[name])} ({wrong} of {len(ckpt.tensors)} tensors differ in shape)",
                                "pass the config.json the checkpoint was saved with (its sizes differ from this one's)")
    _check_dtype(ckpt, name, tag, declared, config_label)
    for other in present[1:]:
        if ckpt.tensors[other].tobytes() != values.tobytes():
            raise CheckpointProblem(ckpt.file_of(other), other, f"tied to {name!r} in {config_label}, but the file "
                                    "stores two different tensors under the two names",
                                    "save the checkpoint again from the tied model, or pass an untied config")
    return values


def _check_dtype(ckpt: CheckpointFiles, name: str, tag: str, declared: Any, config_label: str) -> None:
    """CheckpointProblem where a weight is no float tensor, or not of the dtype the config declares."""
    if tag not in TORCH_NAMES:  # the float tags
        raise CheckpointProblem(ckpt.file_of(name), name, f"dtype {tag}: a weight must be a float tensor",
                                "export the checkpoint again with float weights")
    if declared is not None and TORCH_NAMES[tag] != declared:
        raise CheckpointProblem(ckpt.file_of(name), name, f"dtype {TORCH_NAMES[tag]} ({tag}), but {config_label} "
                                f"says dtype {declared}",
                                f"convert the checkpoint to {declared}, or set the config's dtype to {TORCH_NAMES[tag]}")


def stack_state(ckpt: CheckpointFiles) -> dict[str, Any]:
    """The checkpoint's tensors as the stack reads them: ``safetensors.torch.load_file`` of each file, on the CPU,
    under their model names (a bundle's ``checkpoint/`` prefix stripped, its other arrays left out)."""
    import safetensors.torch  # looked up at call time: the stack's function, whatever wraps it

    out: dict[str, Any] = {}
    for path in dict.fromkeys(ckpt.origin.values()):  # each file once, in the order the strict reader read them
        for key, tensor in safetensors.torch.load_file(str(path), device="cpu").items():
            if key.startswith(ckpt.prefix):
                out[key[len(ckpt.prefix):]] = tensor
    return out


def with_tied_names(state: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """``state`` with each tied tensor under every name of its group: the file stores it once, and
    ``load_state_dict(strict=True)`` wants every name (it copies into the one storage, so the model's tie stays)."""
    out = dict(state)
    for group in groups:
        stored = next((n for n in group if n in state), None)
        if stored is not None:
            out.update({n: state[stored] for n in group if n not in state})
    return out


def poison(model: Any) -> None:
    """Every parameter NaN before a load: whatever the load leaves untouched cannot pass for loaded, even where the
    trained value happens to equal the freshly built one (a norm weight of 1)."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.fill_(float("nan"))


def load(model: Any, ckpt: CheckpointFiles) -> None:
    """Load ``ckpt`` into ``model`` the stack's way: ``load_file``, then ``load_state_dict(strict=True)``.

    ``match`` has checked the file already; a refusal here is the stack's own, passed on with its words."""
    state = with_tied_names(stack_state(ckpt), tie_groups(model))
    poison(model)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointProblem(ckpt.path, None, f"the stack's load_state_dict(strict=True) refused it: "
                                f"{' '.join(str(exc).split())}", "export the checkpoint again") from None
    hooks.after_load(dict(model.state_dict(keep_vars=True)))


def held(model: Any, name: str, like: np.ndarray) -> np.ndarray:
    """The tensor as the model holds it, in the checkpoint's dtype (a float32 copy of bf16 converts back exactly)."""
    value = model.state_dict()[name].detach().float().cpu().numpy()
    return value.astype(like.dtype)


# --- evaluation ------------------------------------------------------------------------------------------


@dataclass
class Evaluation:
    """What one machine says about one checkpoint; ``summary()`` is what ``--out`` writes and ``--against`` reads."""

    logits: np.ndarray
    checksums: dict[str, dict[str, Any]]  # as loaded on this machine
    file_checksums: dict[str, str]  # sha256 of each tensor as stored in the file
    bound: float  # logits_bound: float32 against float64
    deviation: float | None = None  # from float64 on this machine; None when not computed
    device: str = "cpu"
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"checksums": self.checksums, "file_checksums": self.file_checksums, "bound": self.bound,
                "deviation_from_float64": self.deviation, "device": self.device,
                "logits": checksum(self.logits), "problems": self.problems}


def _forward(model: Any, ids: np.ndarray, device: Any) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids).to(device)).logits
    return out.detach().cpu().numpy()


def evaluate(ckpt: CheckpointFiles, model_config: Any, config_label: str, device: str = "cpu",
             with_float64: bool = True) -> Evaluation:
    """Load ``ckpt`` into the model ``model_config`` builds, on ``device``; logits, checksums and deviation."""
    import copy

    from ...training.moe import in_float64

    model = empty_model(model_config)
    stored = match(ckpt, model, model_config, config_label)  # the strict reader's view: clear errors, file checksums
    load(model, ckpt)  # the model's weights: what the stack's loader made of the same files
    ids = fixed_batch(int(model_config.vocab_size))
    logits64 = _forward(in_float64(copy.deepcopy(model)), ids, "cpu") if with_float64 else None
    model = model.to(device)
    logits = _forward(model, ids, device).astype(np.float32)
    deviation = None if logits64 is None else deviation_between(logits, logits64)
    problems: list[str] = []
    checksums, file_checksums = {}, {}
    for name, values in stored.items():
        loaded = held(model, name, values)
        checksums[name] = checksum(loaded)
        file_checksums[name] = sha256(values)
        if checksums[name]["sha256"] != file_checksums[name]:
            problems.append(f"{name}: the tensor the model holds after the load is not the file's "
                            f"({describe_difference(values, loaded)})")
    bound = logits_bound(model_config)
    if deviation is not None and not deviation <= bound:
        problems.append(f"logits on the fixed batch are {deviation:.3g} from float64 on this machine, beyond the bound "
                        f"{bound:.3g}: a kernel on {device} computes this model wrongly")
    return Evaluation(logits, checksums, file_checksums, bound, deviation, str(device), problems)


def describe_difference(expected: np.ndarray, got: np.ndarray) -> str:
    """How two same-shaped tensors differ: elements, where first, and by how many ulps there."""
    a, b = np.ascontiguousarray(expected), np.ascontiguousarray(got)
    if a.shape != b.shape:
        return f"shape {list(b.shape)}, expected {list(a.shape)}"
    width = a.dtype.itemsize
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    differ = a.reshape(-1).view(bits) != b.reshape(-1).view(bits)
    count = int(differ.sum())
    if not count:
        return "bit-identical"
    first = int(np.flatnonzero(differ)[0])
    where = tuple(int(i) for i in np.unravel_index(first, a.shape)) if a.ndim else ()
    x, y = a.reshape(-1)[first], b.reshape(-1)[first]
    ulps = abs(int(np.asarray(x).view(bits)) - int(np.asarray(y).view(bits))) if np.sign(x) == np.sign(y) else None
    step = f", {ulps} ulp" + ("s" if ulps != 1 else "") if ulps is not None else ""
    return f"{count} of {a.size} elements differ, first at {where}: {x.item()!r} -> {y.item()!r}{step}"


# --- two machines ---------------------------------------------------------------------------------------


def compare(here: dict[str, Any], logits_here: np.ndarray, there: dict[str, Any], logits_there: np.ndarray,
            exact: bool = False) -> list[str]:
    """What differs between two machines' summaries of one checkpoint; [] when they agree.

    Checksums must be equal; logits within twice the larger bound (``exact``: bit for bit)."""
    problems: list[str] = []
    a, b = here["checksums"], there["checksums"]
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            problems.append(f"{name}: checksummed on one machine only")
        elif a[name]["sha256"] != b[name]["sha256"]:
            problems.append(f"{name}: checksum differs: sha256 {b[name]['sha256'][:12]}... there, "
                            f"{a[name]['sha256'][:12]}... here (sum {b[name]['sum']!r} there, {a[name]['sum']!r} here)")
    if logits_here.shape != logits_there.shape:
        return problems + [f"logits: shape {list(logits_here.shape)} here, {list(logits_there.shape)} there"]
    deviation = deviation_between(logits_here, logits_there)
    tolerance = 2 * max(float(here["bound"]), float(there["bound"]))
    if exact and not np.array_equal(logits_here.view(np.uint32), logits_there.view(np.uint32)):
        problems.append(f"logits on the fixed batch are not bit-identical (deviation {deviation:.3g}), and the two "
                        "stacks compute the same numerics, so they must be")
    elif not deviation <= tolerance:
        problems.append(f"logits on the fixed batch differ by {deviation:.3g} of their largest, beyond the cross-platform "
                        f"tolerance {tolerance:.3g} (twice the float32 bound u sqrt(n) (L + 1))")
    return problems


def deviation_between(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|, in float64."""
    scale = float(np.max(np.abs(b.astype(np.float64)))) or 1.0
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) / scale
