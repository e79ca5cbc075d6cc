"""The model's own definition, compared: a parameter layout that differs from the reference's is the model's
code changing (a transformers release fusing or splitting modules), never a kernel or a collective.

Weights are seeded per parameter name, so the reference cannot judge such a run at all. The layout is read
from the step-0 gradients' names and shapes. Torch-free: the session imports it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from ..reference.record import RunRecord
from . import step0

METRIC = "model"  # the metric of the finding that says the layout changed
# The tie judged against the config: what a stack did that builds another model than its config asks.
BUILT_OTHERWISE = "the library did not build what the model's config asks"
MODEL_LIBRARIES = ("transformers", "peft", "accelerate", "torch")  # whose releases change a model's code


def layout(record: RunRecord) -> dict[str, tuple[int, ...] | None]:
    """Parameter name -> shape, from the record's step-0 gradients: whole, or in blocks with the shape in the
    digests (None where a record does not say it: such a parameter counts by name only)."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    for name, prefix, array in step0.each(record):
        if prefix == step0.BLOCK_PREFIX:
            shape = record.digests.get(name, {}).get("shape")
            shapes[name] = tuple(shape) if shape else None
        else:
            shapes[name] = tuple(array.shape)
    return shapes


def _count(shapes: Mapping[str, tuple[int, ...] | None], names: list[str]) -> int | None:
    """How many values ``names`` hold; None when a shape is unknown."""
    if any(shapes[n] is None for n in names):
        return None
    return int(sum(int(np.prod(shapes[n], dtype=np.int64)) for n in names))


def _per_module(names: list[str]) -> bool:
    """Names with a numbered module inside a layer (``mlp.experts.3.w1.weight``): per-expert or split modules."""
    return any(re.search(r"\.layers?\.\d+\..*\.\d+\.", n) or re.search(r"\.h\.\d+\..*\.\d+\.", n) for n in names)


def what_changed(before: Mapping[str, tuple[int, ...] | None], after: Mapping[str, tuple[int, ...] | None]) -> str | None:
    """One sentence on how the parameter layout moved from ``before`` (the reference) to ``after``; None if equal."""
    if not before or not after or dict(before) == dict(after):
        return None
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before))
    reshaped = _reshaped(before, after)
    if not (gone or new or reshaped):
        return None
    parts = _regrouped(before, after, gone, new) or _added_and_removed(before, after, gone, new)
    if reshaped:
        parts.append(f"{len(reshaped)} reshaped (e.g. {reshaped[0]} {list(before[reshaped[0]])} -> "
                     f"{list(after[reshaped[0]])})")
    return "; ".join(parts)


def _reshaped(before: Mapping[str, tuple[int, ...] | None], after: Mapping[str, tuple[int, ...] | None]) -> list[str]:
    """The parameters both layouts have, with a known shape on each side, that changed shape; sorted."""
    return sorted(n for n in set(before) & set(after)
                  if before[n] is not None and after[n] is not None and before[n] != after[n])


def _direction(gone: list[str], new: list[str]) -> str:
    """How parameters holding the same values were regrouped, judged by their names."""
    if _per_module(new) and not _per_module(gone):
        return "fused -> per-module"
    if _per_module(gone) and not _per_module(new):
        return "per-module -> fused"
    return "renamed or regrouped"


def _regrouped(before: Mapping[str, tuple[int, ...] | None], after: Mapping[str, tuple[int, ...] | None],
               gone: list[str], new: list[str]) -> list[str]:
    """The names that went and came hold the same number of values: fused, split or renamed; [] otherwise."""
    if not (gone and new) or _count(before, gone) is None or _count(before, gone) != _count(after, new):
        return []
    return [f"{len(gone)} parameters {_direction(gone, new)} as {len(new)} (the same {_count(after, new):,} values, "
            f"e.g. {gone[0]} {list(before[gone[0]] or [])} -> {new[0]} {list(after[new[0]] or [])})"]


def _added_and_removed(before: Mapping[str, tuple[int, ...] | None], after: Mapping[str, tuple[int, ...] | None],
                       gone: list[str], new: list[str]) -> list[str]:
    parts = []
    if gone:
        parts.append(f"{len(gone)} parameters only in the reference (e.g. {gone[0]} {list(before[gone[0]] or [])})")
    if new:
        parts.append(f"{len(new)} only in this run (e.g. {new[0]} {list(after[new[0]] or [])})")
    return parts


def library_changes(reference: RunRecord, run: RunRecord) -> list[str]:
    """'transformers 5.24.0 -> 4.57.6' for each library whose release can change a model's code."""
    out = []
    for library in MODEL_LIBRARIES:
        a = reference.fingerprint.get("versions", {}).get(library)
        b = run.fingerprint.get("versions", {}).get(library)
        if a != b:
            out.append(f"{library} {a} -> {b}")
    return out


def layout_change(reference: RunRecord, run: RunRecord) -> str | None:
    """The model finding's message when the parameter layouts differ, else None. Gradients only missing, with no
    model library changed, are no model change (a stack fault can leave a parameter without one, and the usual
    findings must name it); a parameter with no final weight either is a change of the model's definition."""
    before, after = layout(reference), layout(run)
    change = what_changed(before, after)
    if change is None:
        return None
    libraries = library_changes(reference, run)
    absent = bool(run.digests) and any(name not in run.digests for name in set(before) - set(after))
    only_missing = not absent and not (set(after) - set(before)) and all(after[n] in (None, before[n]) for n in after)
    if only_missing and not libraries:
        return None
    cause = f"the model's code changed with {', '.join(libraries)}" if libraries else "the model's definition changed"
    return (f"{cause}: {change}. Weights are seeded per parameter name, so this run starts elsewhere and the "
            "reference cannot judge its numbers (not a kernel or collective fault); record a reference for this "
            "stack with --gpuregress-record into a folder of its own (--gpuregress-reference-dir), and keep this "
            "one for the stack it was recorded on")


def adapters_only(reference: RunRecord, run: RunRecord) -> bool:
    """Whether every parameter the layouts do not share is a LoRA adapter's (peft builds those, not the model)."""
    before, after = layout(reference), layout(run)
    changed = (set(before) ^ set(after)) | {n for n in set(before) & set(after) if before[n] != after[n]}
    return bool(changed) and all(".lora_" in name for name in changed)


def tie_built_otherwise(reference: RunRecord, run: RunRecord, tied: bool | None) -> tuple[str, str] | None:
    """(the library that built it, message) where the layouts differ by the output head alone: tied to the input
    embeddings on one side only (``tied``: the config's tie_word_embeddings, None where it has none). Building
    against the config is a library's fault, never a layout to re-record over; None otherwise."""
    if tied is None:
        return None
    before, after = layout(reference), layout(run)
    apart = _one_apart(before, after)
    if apart is None or apart[1] != tied:
        return None
    name, separate_here = apart
    embedding = _embedding_like(after if separate_here else before, name)
    if embedding is None:
        return None
    changed = library_changes(reference, run)
    library = next((c.split()[0] for c in changed), "transformers")
    built = "as a tensor of its own" if separate_here else f"sharing {embedding}'s tensor"
    return library, (
        f"the model's config {'ties' if tied else 'does not tie'} the input and output embeddings "
        f"(tie_word_embeddings: {str(tied).lower()}), but this stack built {name} {built} "
        f"({', '.join(changed) or 'no model library changed'}): {BUILT_OTHERWISE}, so every step trains another "
        "model. Not a change to record over: check the library's release notes and report it, and keep this "
        "reference")


def _one_apart(before: Mapping[str, tuple[int, ...] | None],
               after: Mapping[str, tuple[int, ...] | None]) -> tuple[str, bool] | None:
    """The one parameter the layouts do not share, and whether this run has it; None where more differ."""
    new, gone = set(after) - set(before), set(before) - set(after)
    if len(new) + len(gone) != 1 or any(before[n] != after[n] for n in set(before) & set(after)):
        return None
    return next(iter(new or gone)), bool(new)


def _embedding_like(shapes: Mapping[str, tuple[int, ...] | None], head: str) -> str | None:
    """The first input embedding in ``shapes`` of output head ``head``'s shape; None where ``head`` is no head."""
    if not _is_head(head) or shapes[head] is None:
        return None
    return next((n for n in shapes if n != head and shapes[n] == shapes[head] and _is_input_embedding(n)), None)


def is_tie(metric: str, facts: Mapping[str, object]) -> bool:
    """Whether a finding says the library built another model than its config asks (not a layout change)."""
    return metric == METRIC and bool(facts.get("built_by"))


def _is_input_embedding(name: str) -> bool:
    """An input embedding's parameter as architectures name it: embed_tokens, wte, word_embeddings, embed_in."""
    return "embed" in name.removesuffix(".weight").rsplit(".", 1)[-1] or name.endswith("wte.weight")


def _is_head(name: str) -> bool:
    """An output head's parameter as architectures name it: lm_head, output, embed_out, the head's decoder."""
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return leaf in ("lm_head", "output", "embed_out", "decoder", "head") or name.startswith("lm_head")
