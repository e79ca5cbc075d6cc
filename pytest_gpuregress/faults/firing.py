"""How often each injected fault fired: a fault that never fired proves nothing about the case it ran with.

Installers call ``fire()`` where they really change something. Counts go to ``results["faults_fired"]``, are
summed over ranks and launches, and a case whose fault fired zero times fails (``unfired``). Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from . import KINDS, FaultSpec, parse
from .fired import Firing

RESULT_KEY = "faults_fired"


def rank_counts(firings: Iterable[Firing]) -> dict[str, int]:
    """One rank's counts, for its record; a spec given twice sums (both copies act on the same calls)."""
    counts: dict[str, int] = {}
    for firing in firings:
        if firing.counted:
            counts[firing.spec] = counts.get(firing.spec, 0) + firing.count
    return counts


def required(text: str) -> bool:
    """False for kinds that need not fire (a shim, or a fault that acts after the results are delivered)."""
    return not KINDS[parse(text).kind].need_not_fire


def by_rank(texts: Iterable[str], per_rank: list[Mapping[str, int]]) -> dict[str, list[int]]:
    """spec -> its count on each rank of a launch (0 where a rank did not install it), for every spec
    that must fire or that some rank counted."""
    return {text: [counts.get(text, 0) for counts in per_rank] for text in dict.fromkeys(texts)
            if required(text) or any(text in counts for counts in per_rank)}


def notes(texts: Iterable[str], counts: Mapping[str, list[int]]) -> list[str]:
    """The record's "fault injected" notes, with how often each fault fired (per rank when several)."""
    lines = []
    for text in dict.fromkeys(texts):
        reason = KINDS[parse(text).kind].need_not_fire
        if text not in counts:
            lines.append(f"fault injected: {text} (not counted: {reason})")
            continue
        ranks = counts[text]
        times = f"{sum(ranks)} times" + (f" (rank {', rank '.join(f'{r}: {n}' for r, n in enumerate(ranks))})"
                                          if len(ranks) > 1 else "")
        lines.append(f"fault injected: {text} (" + (f"fired {times})" if not reason else f"acted {times}; {reason})"))
    return lines


def totals(results: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """spec -> how often it fired, summed over records' ``results`` (the launches of one case)."""
    summed: dict[str, int] = {}
    for result in results:
        for text, count in result.get(RESULT_KEY, {}).items():
            summed[text] = summed.get(text, 0) + int(count)
    return summed


def unfired(results: Iterable[Mapping[str, Any]]) -> list[str]:
    """A failure message for every fault that must fire and fired zero times in ``results``."""
    return [f"[fault] {text!r} fired 0 times in this run: the run never reached the path it corrupts "
            f"({path(parse(text))}), so this case proves nothing about it; choose a fault that applies to this case "
            "(docs/faults.md)" for text, count in totals(results).items() if count == 0 and required(text)]


# kind, or "kind:mode" -> the path a fault of it acts on, as "no <what the run did not do>"; {key} reads the spec
PATHS: dict[str, str] = {
    "lr_scale": "no optimizer step", "slow_step": "no optimizer step",
    "linear_noise": "no torch.nn.functional.linear call",
    "sdpa_backend": "no torch.nn.functional.scaled_dot_product_attention call",
    "host_op": "no torch.nn.functional.{op} call",
    "hang": "step {step} never completed", "crash": "step {step} never completed",
    "format:fn_as_fnuz": "no e4m3fn bytes decoded by the formats scenario (device.decode)",
    "format:keep_0x80": "no e4m3fn -> e4m3fnuz conversion (device.fn_to_fnuz)",
    "format:fnuz_max_448": "no e4m3fnuz scale computed (device.format_max)",
    "format:flip_overflow": "no overflowing cast to {format} (device.cast)",
    "format:mx_scale_off_by_one": "no MX shared exponent computed (device.mx_scale_exponent)",
    "format:loader_fn_as_fnuz": "no e4m3fn tensor loaded through the stack's {path} loader (the formats io cases)",
    "format:loader_e5m2_as_e4m3fn": "no e5m2 tensor loaded through the stack's {path} loader (the formats io cases)",
    "library:rope_interleaved": "no rotary embedding of transformers' Llama applied (modeling_llama.rotate_half)",
    "library:rmsnorm_default_eps": "no RMSNorm of transformers' Llama applied (LlamaRMSNorm.forward)",
    "library:lora_rslora": "no LoRA adapter made by peft (LoraLayer.update_layer)",
    "library:untied": "no model whose config ties its embeddings built (PreTrainedModel.tie_weights; the zoo's "
                      "tiny-llama-tied is one: --gpuregress-model=tiny-llama-tied)",
    "lora:grad_leak": "no model wrapped with LoRA (adapter.wrap_with_lora)",
    "lora:rank0_slice": "no sharded adapter gathered for saving: adapter_io.gather_for_save under fully_shard, "
                        "Accelerator.get_state_dict of a sharded model under accelerate (on a CPU accelerate runs "
                        "DDP, whose whole tensors have no slice to lose: use lora-fully_shard there)",
    "lora:zero_lora_b": "no adapter written through adapter_io.write_adapter",
    "lora:merge_ulp": "no adapter merged (merging.merge_and_unload)",
    "checkpoint:optimizer_dropped": "no optimizer state loaded (resume_checkpoint.apply_optimizer)",
    "checkpoint:rank0_shard": "no sharded save from a rank other than 0, and no full-state gather "
                              "(sharded.save, full_state.gather)",
    "checkpoint:chunks_permuted": "no sharded load at another world size (sharded.load)",
    "checkpoint:tied_key_dropped": "no save of a tied tensor (full_state.tensors_to_save)",
    "checkpoint:untied": "no reload of a model with tied weights through the stack (full_state.stack_load)",
    "checkpoint:rng_not_restored": "no generator state restored (rng_state.restore)",
    "checkpoint:weights_late": "no loaded weights applied to a resumed trainer (resume_checkpoint.apply_model)",
    "checkpoint:ulp_nudge": "no load of model.layers.{layer}.*.{proj}.weight (hooks.after_load)",
}
_DEFAULTS = {"op": "silu", "step": 1, "format": "e4m3fn", "layer": 1, "proj": "q_proj",
             "path": "safetensors, safe_open, torch_load, dcp or transformers"}


def path(spec: FaultSpec) -> str:
    """What the run would have done had the fault's path been reached, as "no <call>"."""
    if spec.kind == "collective":
        return _collective_path(spec)
    template = PATHS.get(f"{spec.kind}:{spec.get('mode')}", PATHS.get(spec.kind, f"no call that {spec.kind} changes"))
    return template.format(**{**_DEFAULTS, **spec.params})


def _collective_path(spec: FaultSpec) -> str:
    ops = "/".join(sorted(spec.get("op") or ())) or "collective"
    where = [f"of at least {spec.get('min_bytes'):g} bytes" if spec.get("min_bytes") else "",
             f"of at most {spec.get('max_bytes'):g} bytes" if spec.get("max_bytes") is not None else "",
             f"in {spec.get('dtype')}" if spec.get("dtype") else "",
             f"with a {spec.get('reduce_op')} reduction" if spec.get("reduce_op") else "",
             f"on rank {'|'.join(map(str, sorted(spec.ranks)))}" if spec.ranks is not None else ""]
    text = " ".join(["no", ops, "call", *filter(None, where), "between 2 or more ranks"])
    if spec.get("every", 1) > 1:
        text += f" (it fires on 1 matching call in {spec.get('every')})"
    if spec.get("mode") == "stale_chunk":
        text += " (stale_chunk needs a second matching call of the same shape)"
    return text
