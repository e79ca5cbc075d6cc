"""The linear projections of a model's repeated blocks, and the LoRA targets that name them.

Like peft's ``all-linear`` but only inside the blocks (never lm_head, embeddings or a router). What the
blocks hold that no target can adapt (fused MoE expert weights) is listed for the report.
Torch is imported inside the functions: the session side imports this module without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .fsdp2 import decoder_layers
from .moe import num_experts

# Config fields that hold an MoE's number of routed experts, across transformers architectures.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# Why a projection has no adapter, as the report says it before the block paths.
NOT_ASKED = "not in --gpuregress-lora-targets"
NOT_LINEAR = "not a Linear or Conv1D (target_modules cannot adapt one)"
ROUTER = "routers and expert gates (an adapter on one changes which experts run, or how much of one)"
CLASHING = "named like a module that must not be adapted (a router, or one outside the decoder layers)"
PEFT_MOVED = "matched by a target peft moved onto fused expert parameters (so no adapter here)"


@dataclass(frozen=True)
class Projection:
    """One weight of the blocks: its path inside a block (``self_attn.qkv_proj``) and every layer's full name."""

    path: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class BlockProjections:
    """What a model's decoder layers hold for LoRA, each group in model order."""

    targets: tuple[str, ...]  # target_modules adapting exactly ``linear``: leaf names (qkv_proj), a path on a clash
    linear: tuple[Projection, ...]  # every Linear / Conv1D of the blocks that a target names
    routers: tuple[Projection, ...]  # never targeted by default
    not_linear: tuple[Projection, ...]  # weights of other modules (fused experts): no target_modules entry adapts them
    clashing: tuple[Projection, ...]  # Linear / Conv1D whose leaf name and path both name a module to leave alone


@dataclass(frozen=True)
class PeftTargets:
    """What peft really adapted for ``target_modules``: on transformers 5's fused 3-D experts it moves
    ``gate_proj``-style targets to ``target_parameters``, off every Linear they matched elsewhere."""

    modules: frozenset[str]  # full names of the modules given an adapter
    parameters: frozenset[str]  # full names of the parameters peft wrapped itself (ParamWrapper)
    moved: tuple[str, ...]  # the targets peft took off target_modules
    into: tuple[str, ...]  # the target_parameters it put in their place


def is_parameter_wrapper(module: Any) -> bool:
    """peft's ParamWrapper: an adapter on one parameter of a module (``target_parameters``, fused MoE experts)."""
    return hasattr(module, "lora_A") and hasattr(module, "parameter_name")


def peft_targets(model: Any, targets: Sequence[str]) -> PeftTargets:
    """Wrap ``model`` in place (a fresh one; meta will do) as the lora scenario does, and read what peft adapted."""
    import warnings

    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on its own conversion: what this returns says it
        wrapped = get_peft_model(model, LoraConfig(r=1, lora_alpha=1, target_modules=list(targets)))
    modules: set[str] = set()
    parameters: set[str] = set()
    for name, module in wrapped.base_model.model.named_modules():
        if is_parameter_wrapper(module):  # nested wrappers: one per parameter, each a base_layer deeper
            parameters.add(f"{name.replace('.base_layer', '')}.{module.parameter_name}")
        elif hasattr(module, "lora_A"):
            modules.add(name)
    config = wrapped.peft_config["default"]
    kept = set(config.target_modules or [])
    return PeftTargets(frozenset(modules), frozenset(parameters), tuple(t for t in targets if t not in kept),
                       tuple(sorted(getattr(config, "target_parameters", None) or [])))


def matches(target: str, name: str) -> bool:
    """Whether a ``target_modules`` entry selects the module ``name``, as peft matches a list: the whole name or
    a dotted suffix of it (``q_proj``, ``mlp.down_proj``)."""
    return name == target or name.endswith("." + target)


def is_projection(module: Any) -> bool:
    """A torch.nn.Linear or a transformers Conv1D (GPT-2's transposed Linear): what peft's all-linear adapts."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (torch.nn.Linear, Conv1D))


def expert_count(model: Any) -> int | None:
    """The number of routed experts the model's config declares, or None for a dense model."""
    return num_experts(getattr(model, "config", None), EXPERT_COUNT_FIELDS) or None


def is_router(module: Any, experts: int | None) -> bool:
    """In an MoE model (``experts`` set), a module that scores experts: a Linear with one output per expert
    (Mixtral's ``mlp.gate`` before transformers 5), a router's expert-by-hidden weight (``TopKRouter``), or a
    one-output Linear (Qwen2-MoE's ``shared_expert_gate``, scaling the shared expert)."""
    if experts is None:
        return False
    if is_projection(module):
        outputs = module.out_features if hasattr(module, "out_features") else module.weight.shape[1]  # Conv1D: in x out
        return outputs in (1, experts)
    weight = getattr(module, "weight", None)
    return getattr(weight, "ndim", 0) == 2 and weight.shape[0] == experts


def survey(model: Any) -> BlockProjections:
    """What LoRA can adapt in ``model``'s decoder layers (training/models.py ``decoder_layers``); works on the
    meta device."""
    linear, routers, not_linear = (_grouped(found) for found in _block_weights(model))
    targeted, clashing = _targeted(linear, [name for name, _ in model.named_modules() if name])
    return BlockProjections(targets=tuple(dict.fromkeys(targeted.values())), linear=tuple(targeted), routers=routers,
                            not_linear=not_linear, clashing=clashing)


def _targeted(linear: tuple[Projection, ...], every: list[str]) -> tuple[dict[Projection, str], tuple[Projection, ...]]:
    """Each projection with the target that selects it alone (``_target_for``), and those none does (clashing)."""
    allowed = frozenset(n for p in linear for n in p.names)
    chosen = {p: _target_for(p, allowed, every) for p in linear}
    return {p: t for p, t in chosen.items() if t}, tuple(p for p, t in chosen.items() if not t)


def _block_weights(model: Any) -> tuple[dict[str, list[str]], ...]:
    """The decoder layers' (projections, routers, other weight matrices), each path in a block -> full names."""
    import torch

    experts = expert_count(model)
    full_names = {id(module): name for name, module in model.named_modules()}
    linear: dict[str, list[str]] = {}
    routers: dict[str, list[str]] = {}
    not_linear: dict[str, list[str]] = {}
    for layer in decoder_layers(model):
        prefix = full_names[id(layer)]
        for path, module in layer.named_modules():
            name = f"{prefix}.{path}" if path else prefix
            if is_router(module, experts):
                routers.setdefault(path, []).append(name)
            elif is_projection(module):
                linear.setdefault(path, []).append(name)
            elif not isinstance(module, torch.nn.Embedding):  # embeddings are never a target, and no projection
                for param in _weight_matrices(module):
                    not_linear.setdefault(_join(path, param), []).append(f"{name}.{param}")
    return linear, routers, not_linear


def left_out(found: BlockProjections, targets: Sequence[str], asked: bool,
             peft: PeftTargets | None = None) -> dict[str, list[str]]:
    """Block paths ``targets`` leaves without an adapter, by reason; ``asked``: they are the user's (a miss is
    theirs to add); ``peft``: what peft really adapted for them, where known."""
    missed, moved = _unadapted(found, targets, peft)
    wrapped = peft.parameters if peft is not None else frozenset()
    why = {NOT_ASKED if asked else CLASHING: missed, PEFT_MOVED: moved,
           NOT_LINEAR: [p for p in found.not_linear if not wrapped.issuperset(p.names)],
           ROUTER: [p for p in found.routers if not _covered(p, targets, peft)]}
    return {reason: [p.path for p in projections] for reason, projections in why.items() if projections}


def _unadapted(found: BlockProjections, targets: Sequence[str],
               peft: PeftTargets | None) -> tuple[list[Projection], list[Projection]]:
    """The projections without an adapter: (those ``targets`` miss, those peft moved it off onto fused experts)."""
    missed = [p for p in (*found.linear, *found.clashing) if not _covered(p, targets, peft)]
    if peft is None:
        return missed, []
    moved = [p for p in missed if _named(p, peft.moved)]
    return [p for p in missed if p not in moved], moved


def _named(projection: Projection, among: Sequence[str]) -> bool:
    """Whether the targets ``among`` select the projection in every layer."""
    return all(any(matches(t, n) for t in among) for n in projection.names)


def _covered(projection: Projection, targets: Sequence[str], peft: PeftTargets | None) -> bool:
    """Whether every layer's projection has an adapter: as peft wrapped them where known, else as targets name them."""
    return peft.modules.issuperset(projection.names) if peft is not None else _named(projection, targets)


def _target_for(projection: Projection, allowed: frozenset[str], every: Sequence[str]) -> str:
    """Its leaf name, else its path in the block, whichever selects it in every layer and nothing to leave alone
    (a router, the lm_head); else "" (none does)."""
    for target in (projection.path.rsplit(".", 1)[-1], projection.path):
        if all(n in allowed for n in every if matches(target, n)):
            return target
    return ""


def _weight_matrices(module: Any) -> list[str]:
    """The module's own weight matrices, or stacked experts'; not norm gains, nor biases (stacked experts' are 2-D)."""
    return [param for param, value in module.named_parameters(recurse=False)
            if value.ndim >= 2 and not param.endswith("bias")]


def _grouped(found: dict[str, list[str]]) -> tuple[Projection, ...]:
    return tuple(Projection(path, tuple(names)) for path, names in found.items())


def _join(path: str, leaf: str) -> str:
    return f"{path}.{leaf}" if path else leaf
