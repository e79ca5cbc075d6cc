"""Which built-in cases each fault can act in, as measured (benchmarks/fault_reach.py): the fault x case table.

A fault is installed only in the launches of the cases it reaches; a case that none of the injected
faults reaches is skipped as not applicable, with the reason, instead of running clean (which proves
nothing) or failing because the fault never fired. A case a fault reaches must see it fire, or it
fails (firing.py). Cases of a user's own scenario are reached by every fault: only the firing count
can say there. docs/faults.md shows the table (``table_lines``); tests/test_fault_reach.py checks both.
Torch-free: the session imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import FaultSpec, parse

BUILT_IN = ("collectives", "fsdp", "lora", "checkpoint", "triage", "formats", "consensus")

# The columns of the table: each built-in case family, as the prefix of its test id (<scenario>-<case>).
COLUMNS = ("collectives", "fsdp", "fsdp-resume", "fsdp-bf16", "lora-fully_shard", "lora-accelerate", "lora-fully_shard-resume",
           "lora-accelerate-resume", "checkpoint-full-state-dict", "checkpoint-tied", "checkpoint-sharded-2to1",
           "checkpoint-sharded-1to2", "checkpoint-resume", "checkpoint-portability", "triage-equivalence", "triage-oracle",
           "formats", "consensus-devices", "consensus-links")

# Measured on the CPU with benchmarks/fault_reach.py (2 gloo ranks); "acts" means the fault changed something in
# a launch the case reads (the main checkpoint launch carries both full-state-dict and tied).
_STEPPING = ("fsdp", "fsdp-resume", "fsdp-bf16", "lora-fully_shard", "lora-accelerate", "lora-fully_shard-resume",
             "lora-accelerate-resume", "checkpoint-full-state-dict", "checkpoint-tied", "checkpoint-sharded-2to1",
             "checkpoint-sharded-1to2", "checkpoint-resume", "triage-equivalence",
             "triage-oracle")  # an optimizer step (triage-oracle: its one-rank stack run; the float64 run is never faulted)
_DEVICE_WORKLOAD = ("consensus-devices",)  # its MLP runs nn.Linear; its battery torch.matmul (matmul_ulp only)
_FORWARD = (*_STEPPING, "checkpoint-portability", "formats")  # a model's forward pass (linear, attention, silu)
_COLLECTIVE = ("collectives", *(c for c in _STEPPING if c != "checkpoint-sharded-1to2"))  # collectives between ranks
# A resume case trains only steps S = 3 * steps // 4 to the end: a hang or crash after step N < S never happens there.
RESUMES = ("fsdp-resume", "lora-fully_shard-resume", "lora-accelerate-resume")
_FROM_STEP_0 = tuple(c for c in _STEPPING if c not in RESUMES)
_CLIPPING = ("fsdp", "fsdp-resume", "fsdp-bf16", "lora-fully_shard", "lora-accelerate", "lora-fully_shard-resume",
             "lora-accelerate-resume", "triage-equivalence", "triage-oracle")

# kind, or "kind:mode" -> the columns it reaches. Why a column is missing is in WHY_NOT.
REACH: dict[str, tuple[str, ...]] = {
    "collective": (*_COLLECTIVE, "consensus-links"),  # the link sweep moves data only: LINK_OPS
    # bf16 SUM reductions only: the sweep's, and the CPU bf16 lane's gradient reduce-scatters (the other training
    # cases reduce in fp32: the CPU's, and FSDP2's bf16 with fp32 reduction on GPUs)
    "collective:truncate_bf16": ("collectives", "fsdp-bf16"),
    # fp32 -> bf16 casts: where a case trains in bf16 (on a CPU, the bf16 lane only: BF16_ON_GPUS)
    "cast": ("fsdp", "fsdp-resume", "fsdp-bf16", "lora-fully_shard", "lora-accelerate", "lora-fully_shard-resume",
             "lora-accelerate-resume"),
    "emulate_premul_sum": _COLLECTIVE,
    "lr_scale": _STEPPING,
    # Where clipping acts on a real share of the steps: fsdp and lora clip below their typical norm (their configs).
    "clip": _CLIPPING,
    # Each AdamW implementation where a scenario's config runs it (adamw: fsdp fused, lora by wrapper, checkpoint single).
    "adamw:fused": ("fsdp", "fsdp-resume", "fsdp-bf16", "lora-accelerate", "lora-accelerate-resume", "triage-equivalence",
                    "triage-oracle"),
    "adamw:foreach": ("lora-fully_shard", "lora-fully_shard-resume"),
    "adamw:single": tuple(c for c in _STEPPING if c.startswith("checkpoint-")),
    "linear_noise": (*_FORWARD, *_DEVICE_WORKLOAD),
    "matmul_ulp": (*_FORWARD, *_DEVICE_WORKLOAD),  # through F.linear, as linear_noise; consensus is where it is caught
    "sdpa_backend": _FORWARD,
    "host_op": _FORWARD,
    "slow_step": _STEPPING,
    "hang": _FROM_STEP_0,  # hang, crash and teardown_abort act after a completed step: declared, not measured
    "crash": _FROM_STEP_0,
    "teardown_abort": _STEPPING,
    "format": ("formats",),
    "format:loader_fn_as_fnuz": ("formats",),  # only the io cases its loader serves: LOADER_CASES
    "format:loader_e5m2_as_e4m3fn": ("formats",),  # likewise, but never io-transformers: NO_E5M2_CASES
    # The formats io cases carry fp8 and fp4 tensors only; the bf16 lane reads its bf16 weights back through three
    # of the loaders (training/bf16_checkpoint.py).
    "format:loader_bf16_as_fp16": ("fsdp-bf16",),
    # Installed code: the Llama family's forward (every case that runs the tiny Llama), peft's LoRA layers.
    "library:rope_interleaved": tuple(c for c in _FORWARD if c != "formats"),
    "library:lora_rslora": ("lora-fully_shard", "lora-accelerate", "lora-fully_shard-resume", "lora-accelerate-resume"),
    # Models whose config ties their embeddings: the zoo's tiny-llama-tied in fsdp (fsdp-tiny-llama-tied); the tiny
    # Llama unties its own, so the fault never fires in plain fsdp.
    "library:untied": ("fsdp",),
    "lora": ("lora-fully_shard", "lora-accelerate"),
    "lora:rank0_slice": ("lora-fully_shard", "lora-accelerate"),
    # The resume cases load their reference's checkpoint through the same points (training/state_apply.py,
    # rng_state.py). No lora fault acts there: the continuation runs no LoRA check to catch one.
    "checkpoint:optimizer_dropped": (*RESUMES, "checkpoint-sharded-2to1", "checkpoint-sharded-1to2",
                                     "checkpoint-resume"),
    "checkpoint:rank0_shard": ("checkpoint-full-state-dict", "checkpoint-tied", "checkpoint-sharded-2to1",
                               "checkpoint-resume"),
    "checkpoint:chunks_permuted": ("checkpoint-sharded-2to1", "checkpoint-sharded-1to2"),
    "checkpoint:tied_key_dropped": ("checkpoint-full-state-dict", "checkpoint-tied", "checkpoint-resume"),
    "checkpoint:untied": ("checkpoint-full-state-dict", "checkpoint-tied", "checkpoint-resume"),
    "checkpoint:rng_not_restored": (*RESUMES, "checkpoint-resume"),
    "checkpoint:weights_late": (*RESUMES, "checkpoint-resume"),
    "checkpoint:ulp_nudge": ("checkpoint-full-state-dict", "checkpoint-tied", "checkpoint-sharded-2to1",
                             "checkpoint-sharded-1to2", "checkpoint-resume", "checkpoint-portability"),
}

# format:loader_fn_as_fnuz,path=P (and loader_e5m2_as_e4m3fn) misreads inside the stack's loader P, so it acts in the
# formats-io cases whose path calls that loader: DCP reads its files with torch.load, transformers (5.x) with
# safetensors.safe_open.
LOADER_CASES = {"safetensors": ("safetensors",), "safe_open": ("safe_open", "transformers"),
                "torch_load": ("torch_load", "dcp"), "dcp": ("dcp",), "transformers": ("transformers",)}
LOADER_KEYS = ("format:loader_fn_as_fnuz", "format:loader_e5m2_as_e4m3fn")
# transformers' fine-grained fp8 layout is e4m3fn only: io-transformers loads no e5m2 tensor to misread.
NO_E5M2_CASES = ("transformers",)
CASE_WHY_NOT = {("format:loader_e5m2_as_e4m3fn", "formats-io-transformers"):
                "transformers' fine-grained fp8 layout is e4m3fn only: no e5m2 tensor goes through it"}

# On a CPU, accelerate wraps the model in DDP: its collectives are all_reduce and broadcast, and its state dict
# holds whole tensors, so there is no shard to lose. On GPUs it runs FSDP2 and every op and rank0_slice act.
CPU_DDP_OPS = ("all_reduce", "broadcast")
CPU_DDP_COLUMNS = ("lora-accelerate", "lora-accelerate-resume")
# consensus-links sweeps the ops whose every output element comes from one known rank (collectives/plan.py).
LINK_OPS = ("all_gather", "broadcast", "all_to_all")
# collective:mode=truncate_bf16 recomputes reductions only (faults/collective.py TRUNCATED_FAMILIES).
TRUNCATED_OPS = ("all_reduce", "reduce_scatter")
# Cases that train in bf16 on GPUs and in fp32 on a CPU, where only the bf16 lane casts to bf16.
BF16_ON_GPUS = ("fsdp", "fsdp-resume", "lora-fully_shard", "lora-accelerate", "lora-fully_shard-resume",
                "lora-accelerate-resume")
CPU_ONLY_MISSING = {("lora:rank0_slice", "lora-accelerate"): "on a CPU accelerate runs DDP, whose state dict holds "
                                                             "whole tensors: no slice to lose (FSDP2 on GPUs)",
                    **{("cast", c): "on a CPU this case trains in fp32: fsdp-bf16 casts to bf16 there"
                       for c in BF16_ON_GPUS}}

WHY_NOT: dict[str, str] = {
    "collectives": "the sweep runs collectives only: no model, no step",
    "formats": "no optimizer step and no collective: casts and checkpoint files on each device",
    "checkpoint-sharded-1to2": "it trains and saves on 1 rank, then only loads on 2",
    "checkpoint-portability": "inference from the shipped bundle on 1 rank: no optimizer step, no collective",
    "consensus-devices": "one process per device, each alone: an MLP and a matmul battery, no collective, no "
                         "scenario step hooks",
    "consensus-links": "a sweep of data-moving collectives (all-gather, broadcast, all-to-all): no model",
}


def key_of(spec: FaultSpec) -> str:
    mode = spec.get("mode")
    return f"{spec.kind}:{mode}" if mode is not None and f"{spec.kind}:{mode}" in REACH else spec.kind


def column_of(test_id: str) -> str | None:
    """The table column of a built-in test id (``checkpoint-sharded-2to1``, ``formats-io-dcp``), or None."""
    return next((c for c in sorted(COLUMNS, key=len, reverse=True) if test_id == c or test_id.startswith(c + "-")),
                None)


def reaches(spec: FaultSpec, test_id: str, device_kind: str = "cpu") -> bool:
    """Whether ``spec`` can act in the built-in case ``test_id`` on this device; a user's scenario: always."""
    scenario = test_id.split("-", 1)[0]
    if scenario not in BUILT_IN:
        return True
    column = column_of(test_id)
    key = key_of(spec)
    if column is None or column not in REACH[key]:
        return False
    if device_kind == "cpu" and (key, column) in CPU_ONLY_MISSING:
        return False
    if key in LOADER_KEYS and test_id != column:
        paths = LOADER_CASES[spec.get("path")] if spec.get("path") else tuple(p for ps in LOADER_CASES.values() for p in ps)
        if key == "format:loader_e5m2_as_e4m3fn":
            paths = tuple(p for p in paths if p not in NO_E5M2_CASES)
        return any(test_id == f"formats-io-{p}" for p in paths)
    ops = spec.get("op") if spec.kind == "collective" else None
    if key == "collective:truncate_bf16" and test_id != column:
        return _sweep_op(test_id) in set(ops or TRUNCATED_OPS) & set(TRUNCATED_OPS)
    if ops and column == "collectives" and test_id != column:
        return _sweep_op(test_id) in ops
    if ops and column == "consensus-links":
        return bool(set(ops) & set(LINK_OPS))
    if ops and column in CPU_DDP_COLUMNS and device_kind == "cpu":
        return bool(set(ops) & set(CPU_DDP_OPS))
    return True


def _sweep_op(test_id: str) -> str:
    """The one op a sweep case runs: collectives-[proto_<P>-]<op>-..."""
    return next((part for part in test_id.split("-")[1:] if not part.startswith("proto_")), "")


def test_id(scenario: str, case_id: str) -> str:
    """The built-in suite's id of a case: ``fsdp``, ``formats-io-dcp``, ``lora-fully_shard-tiny-qwen2``."""
    return case_id if case_id == scenario else f"{scenario}-{case_id}" if case_id else scenario


def reaching(texts: Iterable[str], scenario: str, case_ids: Iterable[str], device_kind: str = "cpu") -> list[str]:
    """The specs of ``texts`` that reach at least one of the cases (all of the scenario's when none are named)."""
    ids = [test_id(scenario, c) for c in case_ids] or [c for c in COLUMNS if c.split("-")[0] == scenario] or [scenario]
    return [t for t in texts if any(reaches(parse(t), i, device_kind) for i in ids)]


def installed_code(texts: Iterable[str]) -> list[str]:
    """The specs of ``texts`` whose kind is code installed on the machine (a library release): they run in every
    launch, the float64 oracle's too, where a fault of the stack under test never does."""
    from . import KINDS

    return [t for t in texts if KINDS[parse(t).kind].installed_code]


def unreached_reason(texts: Iterable[str], scenario: str, case_id: str, device_kind: str = "cpu") -> str | None:
    """Why the case is skipped when faults are injected and none reaches it; None when one does (or none given)."""
    texts = list(texts)
    tid = test_id(scenario, case_id)
    if not texts or any(reaches(parse(t), tid, device_kind) for t in texts):
        return None
    column = column_of(tid) or tid
    whys = [CASE_WHY_NOT.get((key_of(parse(t)), tid))
            or (CPU_ONLY_MISSING.get((key_of(parse(t)), column), "") if device_kind == "cpu" else "") for t in texts]
    why = "; ".join(filter(None, whys)) or WHY_NOT.get(column, "")
    acts = sorted({c for t in texts for c in REACH.get(key_of(parse(t)), ())
                   if scenario in BUILT_IN and reaches(parse(t), c, device_kind)})
    return (f"--gpuregress-inject {'; '.join(texts)}: no injected fault acts in {tid}" + (f" ({why})" if why else "")
            + (f"; it acts in {', '.join(acts)}" if acts else "") + "; docs/faults.md lists where each fault acts")


def table_lines() -> list[str]:
    """The fault x case table of docs/faults.md, in markdown."""
    rows = ["| fault | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for key, columns in REACH.items():
        cells = []
        for column in COLUMNS:
            if column not in columns:
                cells.append("n/a")
            elif (key, column) in CPU_ONLY_MISSING:
                cells.append("GPU only")
            elif key == "format:loader_fn_as_fnuz":
                cells.append("acts (io cases)")
            elif key == "format:loader_e5m2_as_e4m3fn":
                cells.append("acts (io cases except transformers)")
            elif key == "collective" and column in CPU_DDP_COLUMNS:
                cells.append("acts (CPU: all_reduce, broadcast)")
            elif key == "collective:truncate_bf16":
                cells.append(f"acts (bf16 SUM {', '.join(TRUNCATED_OPS)})")
            elif key == "collective" and column == "consensus-links":
                cells.append(f"acts ({', '.join(LINK_OPS)})")
            else:
                cells.append("acts")
        rows.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return rows
