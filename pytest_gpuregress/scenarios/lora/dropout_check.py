"""Rank side: peft's LoRA dropout, exercised after training (the ``dropout`` LoRA check).

Training keeps ``lora_dropout`` at 0 because CPU dropout masks differ across CPUs (MKL's generator on Intel),
so dropout is checked here instead, within one stack, on the trained adapter: eval, seeded, acts, scale and
placement (docs/lora.md). It draws from a forked RNG, so the rank's random state is as training left it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import adapter, adapter_io, checks

P = 0.1  # the dropout probability checked: peft's examples' usual value
SEED = 1234
SAMPLES = 100_000  # ones through the dropout module: the dropped share's standard deviation is 1e-3 at p = 0.1
SHARE_SLACK = 0.01  # ten standard deviations


def check_dropout(fresh_base: Callable[[], Any], trained: dict[str, np.ndarray], cfg: dict[str, Any],
                  batch: Any) -> list[checks.Finding]:
    """The dropout checks on two fresh peft models carrying the trained adapter, with and without dropout."""
    import torch

    def logits(model: Any) -> np.ndarray:
        with torch.no_grad():
            return adapter_io.to_numpy(model(input_ids=batch).logits.float())

    with torch.random.fork_rng(devices=[batch.device] if batch.device.type == "cuda" else []):
        plain = _adapted(fresh_base(), trained, cfg, 0.0, batch.device).eval()
        kept = adapter.module_targets(plain)
        if kept == []:  # every target became a parameter wrapper, and peft takes dropout on none: nothing to exercise
            return []
        if kept is not None:  # peft refuses dropout on the parameters it wraps (fused experts): the others carry it
            cfg = {**cfg, "target_modules": kept}
            plain = _adapted(fresh_base(), trained, cfg, 0.0, batch.device).eval()
        dropping = _adapted(fresh_base(), trained, cfg, P, batch.device).eval()
        findings: list[checks.Finding] = []
        expected, in_eval = logits(plain), logits(dropping)
        if not np.array_equal(expected, in_eval):
            findings.append(checks.finding("dropout", f"in eval mode the adapter with lora_dropout={P} gives other "
                                           f"logits than without dropout: {checks.difference(expected, in_eval)}"))
        dropping.train()
        torch.manual_seed(SEED)
        first = logits(dropping)
        torch.manual_seed(SEED)
        second = logits(dropping)
        if not np.array_equal(first, second):
            findings.append(checks.finding("dropout", f"in train mode two forwards after torch.manual_seed({SEED}) "
                                           f"give other logits ({checks.difference(first, second)}): the masks do not "
                                           "follow torch's RNG, so no run can be repeated"))
        if np.array_equal(first, in_eval):
            findings.append(checks.finding("dropout", f"in train mode lora_dropout={P} changes nothing: the dropout is "
                                           "never applied"))
        return findings + _scale(dropping, batch.device) + _placement(dropping, batch.device)


def _scale(model: Any, device: Any) -> list[checks.Finding]:
    """The first adapter's own dropout module on ones, in train mode: kept values 1 / (1 - p), a share p dropped."""
    import torch

    module = next(m for name, m in model.named_modules() if name.endswith("lora_dropout.default"))
    torch.manual_seed(SEED)
    with torch.no_grad():
        out = adapter_io.to_numpy(module(torch.ones(SAMPLES, device=device)))
    kept, dropped = out[out != 0], float(np.mean(out == 0))
    findings = []
    if kept.size and not np.all(kept == np.float32(1 / (1 - P))):
        findings.append(checks.finding("dropout", f"kept values are {float(kept.min())!r} to {float(kept.max())!r}, "
                                       f"not 1 / (1 - {P}) = {1 / (1 - P)!r}: the inverted-dropout rescale is wrong"))
    if abs(dropped - P) > SHARE_SLACK:
        findings.append(checks.finding("dropout", f"{dropped:.4f} of the inputs dropped with lora_dropout={P}"))
    return findings


def _placement(model: Any, device: Any) -> list[checks.Finding]:
    """The first LoRA layer in train mode with its lora_B zeroed: its output must be its base layer's, bit for bit."""
    import torch

    layer = next((m for _, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_B")
                  and hasattr(m.base_layer, "in_features")), None)
    if layer is None:
        return []
    torch.manual_seed(SEED)
    x = torch.randn(4, layer.base_layer.in_features, device=device, dtype=layer.base_layer.weight.dtype)
    saved = {name: b.weight.detach().clone() for name, b in layer.lora_B.items()}
    try:
        with torch.no_grad():
            for b in layer.lora_B.values():
                b.weight.zero_()
            torch.manual_seed(SEED)
            adapted = adapter_io.to_numpy(layer(x).float())
            base = adapter_io.to_numpy(layer.base_layer(x).float())
    finally:
        with torch.no_grad():
            for name, b in layer.lora_B.items():
                b.weight.copy_(saved[name])
    if np.array_equal(adapted, base):
        return []
    return [checks.finding("dropout", f"in train mode a LoRA layer whose adapter adds nothing gives other outputs "
                                      f"than its frozen base layer ({checks.difference(base, adapted)}): the "
                                      "adapter's dropout reaches the input the base path shares")]


def _adapted(base: Any, trained: dict[str, np.ndarray], cfg: dict[str, Any], dropout: float, device: Any) -> Any:
    model = adapter.wrap_with_lora(base, {**cfg, "lora_dropout": dropout})
    names = {name for name, _ in model.named_parameters()}
    adapter.load_adapter_tensors(model, {name: values for name, values in trained.items() if name in names})
    return model.to(device)
