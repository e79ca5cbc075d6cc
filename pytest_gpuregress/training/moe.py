"""Mixture-of-Experts helpers: is a config an MoE, and how evenly does its router spread the tokens.

``expert_load`` reads the routers' choices with forward hooks, so it works on plain, FSDP2-wrapped (call on
every rank) and peft models alike. Torch is imported inside the functions only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

# Config fields that name the number of routed experts, by family: Mixtral, Qwen2/3-MoE and OLMoE, DeepSeek.
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _field(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def num_experts(config: Any, fields: tuple[str, ...] = _EXPERT_FIELDS) -> int:
    """The number of routed experts per MoE layer (0 for a dense model): the first of ``fields`` that holds one."""
    for key in fields:
        value = _field(config, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def in_float64(model: Any) -> Any:
    """``model`` in float64, its experts computed by the eager loop: grouped_mm has no float64 kernel, and the
    loop over experts computes the same sums."""
    config = getattr(model, "config", None)
    if config is not None and is_moe(config):
        config._experts_implementation = "eager"  # read at every forward, so it applies to a built model
    return model.double()


def is_moe(config: Any) -> bool:
    """Whether ``config`` (a transformers config or a config.json dict) describes routed experts with top-k routing."""
    top_k = _field(config, "num_experts_per_tok")
    return num_experts(config) > 1 and isinstance(top_k, int) and top_k >= 1


def _router_class(model: Any) -> Any:
    """The router module class transformers records ``router_logits`` from (``_can_record_outputs``), or None."""
    for module in model.modules():
        recorders = getattr(module, "_can_record_outputs", None) or {}
        target = recorders.get("router_logits") if isinstance(recorders, Mapping) else None
        target = getattr(target, "target_class", target)
        if isinstance(target, type):
            return target
    return None


def router_modules(model: Any) -> list[tuple[int, Any]]:
    """(decoder layer index, router) of every MoE layer, in order: instances of the class transformers records
    router logits from, else (no ``_can_record_outputs``) an ``mlp``/``block_sparse_moe`` block's ``gate``/``router``."""
    cls = _router_class(model)
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        if cls is not None:
            hit = isinstance(module, cls)
        else:
            hit = bool(re.search(r"\.(mlp|block_sparse_moe)\.(gate|router)$", name))
        match = _LAYER.search(name)
        if hit and match and int(match[1]) not in found:
            found[int(match[1])] = module
    return sorted(found.items(), key=lambda item: item[0])


def _selected(output: Any, top_k: int) -> Any:
    """The [tokens, top_k] expert indices a router chose, from its output."""
    import torch

    if isinstance(output, (tuple, list)):
        if len(output) >= 3 and torch.is_tensor(output[2]) and not output[2].is_floating_point():
            return output[2]  # transformers v5 routers return (logits, top-k weights, top-k indices)
        output = output[0]
    logits = output.reshape(-1, output.shape[-1])
    return torch.topk(logits.float(), top_k, dim=-1).indices  # softmax keeps the order: same choice as on probs


def mean_expert_load(model: Any, input_ids: Any, device: Any) -> Any:
    """``expert_load`` averaged over the ranks (collective), on ``device``: NCCL cannot all-reduce a CPU tensor."""
    import torch
    import torch.distributed as dist

    load = torch.from_numpy(expert_load(model, input_ids)).to(device)
    dist.all_reduce(load)
    return load / dist.get_world_size()


def expert_load(model: Any, input_ids: Any) -> np.ndarray:
    """[MoE layers, experts] float64: each expert's share of routed token-slots on ``input_ids`` (rows sum to 1).
    One ``no_grad`` forward in eval mode (no router jitter), modes restored. ValueError without routers."""
    routers = router_modules(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router modules: expert_load needs a Mixture-of-Experts model")
    default_k = _field(getattr(model, "config", None), "num_experts_per_tok")
    counts: dict[int, Any] = {}
    handles = [router.register_forward_hook(_tally(counts, layer, router, default_k)) for layer, router in routers]
    try:
        _eval_forward(model, input_ids)
    finally:
        for handle in handles:
            handle.remove()
    missing = [layer for layer, _ in routers if layer not in counts]
    if missing:
        raise RuntimeError(f"the routers of layers {missing} did not run in the forward pass")
    return _shares([counts[layer].numpy() for layer, _ in routers])


def _shares(rows: list[np.ndarray]) -> np.ndarray:
    """The rows as one float64 array, each divided by its sum; zeros pad a row narrower than the widest."""
    load = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.float64)
    for i, row in enumerate(rows):
        load[i, : len(row)] = row / row.sum()
    return load


def _tally(counts: dict[int, Any], layer: int, router: Any, default_k: Any) -> Any:
    """A forward hook adding the experts ``router`` chose to ``counts[layer]`` (a float64 bincount)."""
    import torch

    top_k = int(getattr(router, "top_k", None) or default_k or 1)
    experts = int(getattr(router, "num_experts", None) or router.weight.shape[0])

    def hook(_module: Any, _args: Any, output: Any) -> None:
        chosen = _selected(output, top_k).reshape(-1).long()
        tally = torch.bincount(chosen.cpu(), minlength=experts).double()
        counts[layer] = tally if layer not in counts else counts[layer] + tally

    return hook


def _eval_forward(model: Any, input_ids: Any) -> None:
    """One ``no_grad`` eval-mode forward of ``input_ids`` (a batch or a sequence); every module's mode restored."""
    import torch

    tokens = input_ids if torch.is_tensor(input_ids) else torch.as_tensor(np.asarray(input_ids))
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    param = next(model.parameters(), None)
    if param is not None:
        tokens = tokens.to(param.device)
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            model(input_ids=tokens)
    finally:
        for module, training in modes:
            module.training = training
