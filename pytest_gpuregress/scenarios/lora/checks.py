"""The LoRA checks: pure functions from tensors (numpy) to findings, a small dict (check, message, facts). No torch,
so they unit-test in milliseconds. Every message names the adapter tensor and the module it targets."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ...findings import CheckFinding
from . import bounds

# The checks every LoRA run makes (what each one checks: docs/lora.md); triage/naming.py names what a
# failed one points at, from the facts it measured.
CHECKS: tuple[str, ...] = ("frozen-base", "adapter-nonzero", "sharded-save", "adapter-roundtrip", "merge", "dropout")

Finding = dict[str, Any]  # {"check": name, "message": one line, "facts": what was measured}: JSON in the record

# "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" (a parameter) or
# "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" (a key of the saved file)
_ADAPTER = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<which>lora_[AB])(?:\.[^.]+)?\.weight$")


def finding(check: str, message: str, **facts: Any) -> Finding:
    """A check's finding: what failed, where, and the ``facts`` measured about it (triage names the component)."""
    if check not in CHECKS:
        raise ValueError(f"unknown lora check {check!r}; known: {', '.join(CHECKS)}")
    return {"check": check, "message": message, "facts": facts}


def shown_findings(items: Iterable[Mapping[str, Any]], per_check: int = 4) -> list[CheckFinding]:
    """At most ``per_check`` findings of each kind (a check, and which facts it measured), then one that counts the
    rest of that kind (a sliced save fails every tensor alike): findings of another kind are never hidden behind it."""
    shown: list[CheckFinding] = []
    counts: dict[tuple[str, tuple[str, ...]], int] = {}
    last: dict[tuple[str, tuple[str, ...]], CheckFinding] = {}
    for item in items:
        found = CheckFinding.of(item)
        kind = (found.check, tuple(sorted(found.facts)))
        counts[kind] = counts.get(kind, 0) + 1
        if counts[kind] <= per_check:
            last[kind] = found
            shown.append(found)
    for kind, count in counts.items():
        if count > per_check:
            shown.append(replace(last[kind], message=f"... and {count - per_check} more findings like these"))
    return shown


def split_adapter_name(name: str) -> tuple[str, str] | None:
    """(targeted module, "lora_A" | "lora_B") of an adapter parameter or saved key; None for anything else."""
    match = _ADAPTER.match(name)
    return (match["module"], match["which"]) if match else None


def is_adapter(name: str) -> bool:
    return _ADAPTER.match(name) is not None


def describe(name: str) -> str:
    """"lora_B of model.layers.1.self_attn.q_proj" for an adapter name; the name without peft's prefix otherwise."""
    parts = split_adapter_name(name)
    return f"{parts[1]} of {parts[0]}" if parts else name.removeprefix("base_model.model.")


def canonical(name: str) -> str:
    """The key an adapter tensor has in peft's saved file: no adapter name ("default")."""
    parts = split_adapter_name(name)
    return f"base_model.model.{parts[0]}.{parts[1]}.weight" if parts else name


def _shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def difference(expected: np.ndarray, got: np.ndarray) -> str:
    """What differs between two same-shaped tensors, in words: zeros, or how many elements and by how much."""
    if got.size and not np.any(got) and np.any(expected):
        return "is all zeros"
    differ = expected.view(np.uint8).reshape(expected.size, -1) != got.view(np.uint8).reshape(got.size, -1)
    count = int(differ.any(axis=1).sum())
    worst = float(np.max(np.abs(expected.astype(np.float64) - got.astype(np.float64))))
    return f"differs in {count} of {expected.size} elements (largest difference {worst:.3g})"


# --- frozen-base -----------------------------------------------------------------------------------


def check_frozen(leaked: Mapping[str, int], initial: Mapping[str, str], final: Mapping[str, str]) -> list[Finding]:
    """``leaked``: base parameter -> first step it had a gradient (the library left it trainable); ``initial``/``final``:
    sha256 per base weight (a change with no gradient ever: the optimizer, a collective or a load wrote it)."""
    out = [finding("frozen-base", f"frozen base weight {describe(name)} received a gradient at step {step} "
                                  "(only lora_A/lora_B may): the library left it trainable", left_trainable=True)
           for name, step in leaked.items()]
    for name, digest in initial.items():
        if final.get(name) == digest:
            continue
        if name not in final:
            out.append(finding("frozen-base", f"base weight {describe(name)} is missing after training",
                               left_trainable=True))
        elif name in leaked:
            out.append(finding("frozen-base", f"base weight {describe(name)} changed during training: it is no longer "
                                              "bit-identical to its initial digest, stepped with the gradient it "
                                              f"received from step {leaked[name]}", left_trainable=True))
        else:
            out.append(finding("frozen-base", f"base weight {describe(name)} changed during training without ever "
                                              "receiving a gradient: no longer bit-identical to its initial digest "
                                              "(an optimizer stepping it anyway, or a collective or load writing "
                                              "into it)"))
    return out


# --- adapter-nonzero -------------------------------------------------------------------------------


def check_nonzero(adapters: Mapping[str, np.ndarray], targeted: Iterable[str]) -> list[Finding]:
    """Every targeted module has a non-empty lora_A and lora_B, and every lora_B moved away from its zero init."""
    present = {split_adapter_name(n) for n in adapters}
    out = [finding("adapter-nonzero", f"{which} of {module} is missing: the module is a target but has no adapter",
                   missing=True)
           for module in targeted for which in ("lora_A", "lora_B") if (module, which) not in present]
    for name, values in adapters.items():
        if values.size == 0:
            out.append(finding("adapter-nonzero", f"{describe(name)} is empty (shape {_shape(values.shape)})"))
        elif name.find("lora_B") >= 0 and not np.any(values):
            out.append(finding("adapter-nonzero", f"{describe(name)} is all zeros after training"))
    return out


# --- sharded-save and adapter-roundtrip ------------------------------------------------------------


def check_saved(saved: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray], world_size: int) -> list[Finding]:
    """The saved file (peft's keys) against the gathered full tensors (parameter names)."""
    expected = {canonical(name): name for name in trained}
    out = [finding("adapter-roundtrip", f"{describe(key)} is missing from the saved adapter")
           for key in sorted(set(expected) - set(saved))]
    out += [finding("adapter-roundtrip", f"the saved adapter holds {describe(key)}, which was not trained")
            for key in sorted(set(saved) - set(expected)) if is_adapter(key)]
    out += [f for key, name in expected.items() if key in saved
            for f in _saved_tensor(key, trained[name], saved[key], world_size)]
    return out


def _saved_tensor(key: str, full: np.ndarray, got: np.ndarray, world_size: int) -> list[Finding]:
    """One saved tensor against the gathered full one: its shape (one rank's slice?), dtype and bits."""
    if got.shape != full.shape:
        slice_ = (len(full.shape) and got.shape[1:] == full.shape[1:]
                  and -(-full.shape[0] // world_size) == got.shape[0])
        why = ": the save holds one rank's slice, not every rank's" if slice_ else ""
        return [finding("sharded-save", f"{describe(key)} saved with shape {_shape(got.shape)}, the full tensor "
                                        f"is {_shape(full.shape)}{why}")]
    if got.dtype != full.dtype:
        return [finding("adapter-roundtrip", f"{describe(key)} saved as {got.dtype}, trained as {full.dtype}")]
    if not np.array_equal(full.view(np.uint8), got.view(np.uint8)):
        return [finding("adapter-roundtrip", f"{describe(key)} {difference(full, got)} in the saved file")]
    return []


def check_reloaded(reloaded: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray]) -> list[Finding]:
    """The adapter tensors of the reloaded model, bit for bit against the trained ones."""
    out: list[Finding] = []
    by_key = {canonical(n): v for n, v in reloaded.items()}
    for name, full in trained.items():
        got = by_key.get(canonical(name))
        if got is None:
            out.append(finding("adapter-roundtrip", f"{describe(name)} is missing after reload"))
        elif got.shape != full.shape:
            out.append(finding("adapter-roundtrip", f"{describe(name)} has shape {_shape(got.shape)} after reload, "
                                                    f"trained {_shape(full.shape)}"))
        elif not np.array_equal(full.view(np.uint8), got.astype(full.dtype).view(np.uint8)):
            out.append(finding("adapter-roundtrip", f"{describe(name)} {difference(full, got.astype(full.dtype))} "
                                                    "after reload"))
    return out


def check_logits(check: str, what: str, expected: np.ndarray, got: np.ndarray, bound: float,
                 **facts: Any) -> list[Finding]:
    """Logits of two models on the fixed batch: equal within ``bound`` (0: bit for bit). ``facts``: what else was
    measured about the two models, kept with a finding."""
    if expected.shape != got.shape:
        return [finding(check, f"{what}: logits have shape {_shape(got.shape)}, expected {_shape(expected.shape)}")]
    deviation = float(np.max(np.abs(expected.astype(np.float64) - got.astype(np.float64)))) if got.size else 0.0
    if not np.isfinite(deviation) or deviation > bound:
        limit = "bit for bit" if bound == 0 else f"the bound {bound:.3g}"
        return [finding(check, f"{what}: logits on the fixed batch differ by up to {deviation:.3g}, beyond {limit}",
                        **facts)]
    return []


def forward_replaced(model: Any) -> str | None:
    """The function an instance's ``forward`` was replaced with (an autocast or output-casting wrapper a library puts
    on the model it prepares), as ``module.qualname``; None where the model runs its class's own forward."""
    forward = getattr(model, "__dict__", {}).get("forward")
    if forward is None:
        return None
    function = getattr(forward, "__func__", forward)
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', type(function).__name__)}"


# --- merge -------------------------------------------------------------------------------------------


def check_merged_weight(module: str, merged: np.ndarray, base: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray,
                        scale: float, dtype: str) -> list[Finding]:
    """One merged weight against W + scale * B @ A in float64, within the rounding bound of that sum (bounds.py)."""
    if merged.shape != base.shape:
        return [finding("merge", f"merged weight of {module} has shape {_shape(merged.shape)}, the base weight "
                                 f"{_shape(base.shape)}")]
    excess = bounds.merge_excess(merged, base, lora_a, lora_b, scale, dtype)
    if not excess.count:
        return []
    off = (f"merged weight of {module} is off W + scale*lora_B@lora_A in {excess.count} of {merged.size} elements, "
           f"up to {excess.worst_ulps:.2f} ulps ({excess.worst_ratio:.2f}x the rounding bound) at {list(excess.index)}")
    factor = bounds.merge_factor(merged, base, lora_a, lora_b, scale, dtype)
    if factor is None:
        return [finding("merge", off)]
    return [finding("merge", f"{off}; it is W + {factor:.6g} x scale*lora_B@lora_A within rounding "
                             f"({_factor_meaning(factor, scale)})", factor=factor, scale=scale)]


def _factor_meaning(factor: float, scale: float) -> str:
    """What an exact factor on the adapter's product says of the arithmetic that made it."""
    close = lambda a, b: abs(a - b) <= 1e-3 * max(abs(b), 1e-12)  # noqa: E731
    if close(factor, scale):
        return f"the adapter's scaling {scale:g} applied twice"
    if close(factor * scale, 1.0):
        return f"the adapter's scaling {scale:g} left out"
    if close(factor, 0.0):
        return "the adapter was not merged"
    if close(factor, -1.0):
        return "the adapter's product subtracted"
    return f"the product scaled by {factor:.6g} where the adapter's scaling is {scale:g}"


def merge_findings(items: Iterable[Iterable[Mapping[str, Any]]]) -> list[Finding]:
    """The findings of every rank, rank 0's first; a finding another rank alone made says which rank."""
    seen: set[tuple[str, str]] = set()
    out: list[Finding] = []
    for rank, findings in enumerate(items):
        for item in findings:
            key = (item["check"], item["message"])
            if key in seen:
                continue
            seen.add(key)
            message = item["message"] if rank == 0 else f"{item['message']} (on rank {rank})"
            out.append({"check": item["check"], "message": message, "facts": item.get("facts") or {}})
    return out
