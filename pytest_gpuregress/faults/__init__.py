"""Fault injection: emulate the stack bugs this plugin exists to catch, on any machine (docs/faults.md).

A spec ``kind:key=value,...`` (``--gpuregress-inject``) is validated at configure time against its kind's
schema, before any rank starts; the ranks then ``install`` it. Torch-free: installers live in modules of
their own, imported on the ranks. A new kind is an ``install(spec, ctx) -> Firing`` module plus a
``FaultKind`` in ``KINDS``; it reaches this project's code only through fault points (fault_points.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .. import activities as act
from ..errors import BadFaultSpec
from ..fault_points import FaultSpec

if TYPE_CHECKING:
    from .fired import Firing

COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
REDUCE_OPS = ("sum", "avg", "max", "min", "premul_sum")
# Short names used in case ids and messages -> torch dtype names. Either spelling is accepted.
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int32": "int32",
               "fp8e4m3": "float8_e4m3fn", "fp8e5m2": "float8_e5m2", "fp64": "float64"}


ParamKind = Literal["number", "int", "choice", "choices", "ranks", "dtype"]


@dataclass(frozen=True)
class Param:
    """One key of a fault spec: its type and, for choices, the allowed values ('|' joins several)."""

    kind: ParamKind
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None

    def parse(self, value: str) -> Any:
        """``value`` read as this key's kind; ValueError when it is not one the key allows."""
        parsed, allowed = _READERS[self.kind](self, value)
        if not allowed:
            raise ValueError
        return parsed

    def describe(self) -> str:
        at_least = f" of at least {self.minimum:g}" if self.minimum is not None else ""
        allowed = {"number": f"a number{at_least}", "int": f"an integer{at_least}",
                   "ranks": "rank numbers (0 or more) joined by '|'",
                   "dtype": "one of " + ", ".join(sorted(set(DTYPE_NAMES) | set(DTYPE_NAMES.values())))}
        if self.kind in ("choice", "choices"):
            joined = "|".join(self.choices)
            return f"one of {joined}" + (" (several joined by '|')" if self.kind == "choices" else "")
        return allowed[self.kind]


def _number(param: Param, value: str) -> tuple[float, bool]:
    number = float(value) if param.kind == "number" else int(value)
    return number, param.minimum is None or number >= param.minimum


def _ranks(param: Param, value: str) -> tuple[frozenset[int], bool]:
    ranks = frozenset(int(r) for r in value.split("|"))
    return ranks, min(ranks) >= 0


def _dtype(param: Param, value: str) -> tuple[str, bool]:
    name = DTYPE_NAMES.get(value, value)
    return name, name in DTYPE_NAMES.values()


def _choices(param: Param, value: str) -> tuple[frozenset[str], bool]:
    picked = frozenset(value.split("|"))
    return picked, picked <= set(param.choices)


# Each kind of key: its value read from the spec's text, and whether the key allows it.
_READERS: dict[str, Callable[[Param, str], tuple[Any, bool]]] = {
    "number": _number, "int": _number, "ranks": _ranks, "dtype": _dtype, "choices": _choices,
    "choice": lambda param, value: (value, value in param.choices),
}


@dataclass(frozen=True)
class FaultKind:
    name: str
    installer: str  # "module:function", relative to this package, called as function(spec, ctx) -> Firing on each rank
    help: str
    params: dict[str, Param] = field(default_factory=dict)
    required: tuple[str, ...] = ()  # keys a spec of this kind must give
    # It acts only between ranks (through a collective, or a shard that is not the whole): True for
    # every spec of the kind, or the modes that do. With one rank such a fault could never fire.
    needs_peers: bool | tuple[str, ...] = False
    # Why a spec of this kind need not fire ("" : it must, or the case it ran with fails; faults/firing.py).
    need_not_fire: str = ""
    # Code installed on the machine (a library release), not a fault of the stack under test: it runs in every
    # launch, the float64 oracle's too, as the library's code would.
    installed_code: bool = False


_RANKS = Param("ranks", "only these ranks ('|'-separated)")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_STEP = Param("int", "the step after which it fires", minimum=0)

KINDS: dict[str, FaultKind] = {k.name: k for k in (
    FaultKind("collective", ".collective:install", "corrupt the output of matching collectives", {
        "op": Param("choices", "which collectives", COLLECTIVE_OPS),
        "mode": Param("choice", "nudge: one element x (1+rel); scale: every element x (1+rel), an AVG divided "
                                "by the wrong count or a PREMUL_SUM factor off; zero_tail: the last `count` elements; "
                                "zeros; stale_chunk: chunk `chunk` keeps the previous call's value; truncate_bf16: a "
                                "bf16 SUM or AVG all-reduce or reduce-scatter rounds toward zero instead of to nearest "
                                "even; swap: two elements of the output exchanged (at a third and two thirds); "
                                "missing: the call raises 'Backend ... does not support ...' on every rank, as a backend "
                                "that lacks the op does",
                      ("nudge", "zero_tail", "zeros", "stale_chunk", "truncate_bf16", "scale", "swap", "missing")),
        "rel": Param("number", "relative size of a nudge or a scale (default 1e-3)"),
        "add": Param("number", "a nudge adds this to the element instead (an absolute error, e.g. 1e-5)"),
        "at": Param("choice", "which element a nudge changes: middle (default), first or last (the tail of a "
                              "buffer, where NCCL left a bf16 AVG's last elements at zero)", ("middle", "first", "last")),
        "count": Param("int", "elements zeroed by zero_tail (default 8)", minimum=1),
        "chunk": Param("int", "which chunk stale_chunk restores (default -1, the last)"),
        "pieces": Param("int", "chunks a single-tensor output is cut into for stale_chunk (default 2)", minimum=2),
        "min_bytes": Param("number", "smallest matching message (the larger of input and output)", minimum=0),
        "max_bytes": Param("number", "largest matching message", minimum=0),
        "dtype": Param("dtype", "only this dtype"),
        "reduce_op": Param("choice", "only this reduction", REDUCE_OPS),
        "ranks": _RANKS,
        "rank": _RANKS,
        "every": Param("int", "fire on 1 matching call in N", minimum=1),
        "from_step": Param("int", "fire only from this training step on: a bug that starts late (a resumed run "
                                  "starts at its checkpoint's step)", minimum=0),
    }, needs_peers=True),
    FaultKind("emulate_premul_sum", ".collective:install_premul_sum_emulation",
              "give gloo a PREMUL_SUM all-reduce (input x factor, then SUM), so a premul_sum fault can be shown "
              "caught on a CPU", needs_peers=True,
              need_not_fire="a shim that gives gloo PREMUL_SUM, not a fault: it corrupts nothing"),
    FaultKind("lr_scale", ".training:install_lr_scale", "every optimizer step uses lr x factor", {
        "factor": Param("number", "the learning-rate factor (default 1.01)"), "ranks": _RANKS, "rank": _RANKS}),
    FaultKind("clip", ".training:install_clip", "gradient clipping goes wrong on the steps where it acts", {
        "mode": Param("choice", "scale: the clipped gradients x (1+rel), a coefficient off by rel; skip: nothing is "
                                "clipped", ("scale", "skip")),
        "rel": Param("number", "relative error of scale (default 1e-3)"), "ranks": _RANKS, "rank": _RANKS},
        required=("mode",)),
    FaultKind("adamw", ".training:install_adamw", "one AdamW implementation steps with lr x factor; the others are "
              "right", {
                  "mode": Param("choice", "the implementation: single (foreach=False), foreach, fused",
                                ("single", "foreach", "fused")),
                  "factor": Param("number", "the learning-rate factor inside it (default 1.001)"),
                  "ranks": _RANKS, "rank": _RANKS}, required=("mode",)),
    FaultKind("linear_noise", ".training:install_linear_noise",
              "every F.linear output x (1 +- rel), a fixed sign per output feature: legitimate kernel drift at 1e-7", {
                  "rel": Param("number", "relative change (default 1e-7)"),
                  "rows": Param("int", "only outputs of this many rows (tokens): a GEMM kernel picked by shape, as "
                                       "cuBLAS and hipBLASLt pick them", minimum=1),
                  "features": Param("int", "only outputs of this many features (a projection's width): a GEMM "
                                           "kernel picked by N", minimum=1),
                  "elements": Param("choice", "all (default: each by its feature's sign) or last: only the last "
                                              "element of each output, x (1 + rel), in place (one wrong element)",
                                    ("all", "last")),
                  "ranks": _RANKS, "rank": _RANKS}),
    FaultKind("cast", ".casts:install_cast", "a conversion kernel with the wrong rounding", {
        "mode": Param("choice", "truncate_bf16: every fp32 -> bf16 cast (aten _to_copy) rounds toward zero instead "
                                "of to nearest even", ("truncate_bf16",)),
        "ranks": _RANKS, "rank": _RANKS}, required=("mode",)),
    FaultKind("matmul_ulp", ".matmul:install_matmul_ulp",
              "the first element of every matmul, mm, bmm and F.linear output one ulp away from zero: one device "
              "with a failing part, for scenario consensus", {
                  "after": Param("int", "calls left alone before it starts (default 0)", minimum=0),
                  "ranks": _RANKS, "rank": _RANKS}),
    FaultKind("sdpa_backend", ".kernels:install_sdpa_backend", "attention runs on another SDPA backend (a missing "
              "fused kernel); the kernel inventory must name the change", {
                  "backend": Param("choice", "the backend forced (default math)", ("math", "flash", "efficient", "cudnn")),
                  "ranks": _RANKS, "rank": _RANKS}),
    FaultKind("host_op", ".kernels:install_host_op", "an op falls back to the CPU (on a CPU-only build the GPU is "
              "emulated by a device tag); the run must fail naming the op", {
                  "op": Param("choice", "the op that falls back (default silu)", ("silu",)),
                  "ranks": _RANKS, "rank": _RANKS}),
    FaultKind("slow_step", ".kernels:install_slow_step", "every optimizer step sleeps; the throughput ratio must show it", {
        "seconds": Param("number", "how long (default 0.2)", minimum=0), "ranks": _RANKS, "rank": _RANKS}),
    FaultKind("hang", ".process:install_hang", "the rank sleeps after completing a step", {
        "rank": _RANKS, "ranks": _RANKS, "step": _STEP, "seconds": Param("number", "how long (default 3600)", minimum=0)}),
    FaultKind("crash", ".process:install_crash", "the rank fails after completing a step", {
        "rank": _RANKS, "ranks": _RANKS, "step": _STEP,
        "how": Param("choice", "raise an exception, exit, or abort", ("raise", "exit", "abort"))}),
    FaultKind("teardown_abort", ".process:install_teardown_abort",
              "SIGABRT after results are delivered (what gloo does at exit on torch 2.13); a correct launcher ignores it",
              {"rank": _RANKS, "ranks": _RANKS},
              need_not_fire="it acts at teardown, after the results are delivered, so no record can count it"),
    FaultKind("format", ".formats:install_format", "a number-format bug of docs/faults.md section 2, for scenario formats", {
        "mode": Param("choice", "fn_as_fnuz: e4m3fn bytes read as e4m3fnuz; keep_0x80: the conversion to fnuz keeps "
                                "0x80; fnuz_max_448: 448 used as e4m3fnuz's maximum for scales; flip_overflow: a "
                                "saturating cast gives NaN/inf on overflow, and the reverse; mx_scale_off_by_one: "
                                "the MX shared exponent is off by `by`; loader_fn_as_fnuz: the stack's own "
                                "checkpoint loader (of `path`, default all) hands e4m3fn tensors back as e4m3fnuz; "
                                "loader_e5m2_as_e4m3fn: it hands e5m2 tensors back as e4m3fn; loader_bf16_as_fp16: "
                                "it hands bf16 tensors back as fp16 (the bf16 lane's checkpoint)",
                      ("fn_as_fnuz", "keep_0x80", "fnuz_max_448", "flip_overflow", "mx_scale_off_by_one",
                       "loader_fn_as_fnuz", "loader_e5m2_as_e4m3fn", "loader_bf16_as_fp16")),
        "path": Param("choice", "the loader modes: the stack's I/O path whose loader "
                                "misreads (default every one)",
                      ("safetensors", "safe_open", "torch_load", "dcp", "transformers")),
        "format": Param("choice", "the format flip_overflow changes (default e4m3fn)",
                        ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "e8m0fnu", "e2m1fn")),
        "by": Param("int", "exponents the MX scale is off by (default 1)", minimum=1),
        "ranks": _RANKS, "rank": _RANKS}, required=("mode",)),
    FaultKind("lora", ".lora:install", "a peft/accelerate LoRA bug, for scenario lora (docs/lora.md)", {
        "mode": Param("choice", "grad_leak: one base weight stays trainable; rank0_slice: the adapter is saved from "
                                "each rank's shard; zero_lora_b: one lora_B saved as zeros; merge_ulp: one layer's "
                                "merged weight one ulp up; merge_scaled_twice: one layer merged as W + s*s*B@A (the "
                                "scaling applied twice); dropout_in_eval: nn.Dropout (peft's lora_dropout) drops in "
                                "eval mode too; dropout_unseeded: its masks ignore torch.manual_seed; dropout_shared: "
                                "peft's LoRA Linear drops the input the frozen base layer reads too; forward_wrapped: the "
                                "peft model's forward runs under an autocast to bfloat16 that a reloaded model lacks",
                      ("grad_leak", "rank0_slice", "zero_lora_b", "merge_ulp", "merge_scaled_twice", "dropout_in_eval",
                       "dropout_unseeded", "dropout_shared", "forward_wrapped")),
        "layer": Param("int", "decoder layer of the affected module (default 1)"),
        "proj": Param("choice", "projection of the affected module (default q_proj)", _PROJECTIONS),
        "ranks": _RANKS, "rank": _RANKS}, required=("mode",), needs_peers=("rank0_slice",)),
    FaultKind("library", ".library:install", "a library release that computes another function from the same "
              "parameters (docs/triage.md); it runs in every launch, the float64 oracle's too", {
                  "mode": Param("choice", "rope_interleaved: transformers' Llama rotate_half pairs neighbouring "
                                          "features instead of the two halves; lora_rslora: peft scales an adapter "
                                          "by alpha / sqrt(r) instead of alpha / r; untied: transformers' "
                                          "tie_weights ties nothing, so a tied model gets an output head of its own; "
                                          "numpy_searchsorted: numpy's searchsorted returns the next index for one "
                                          "value in 64, so the synthetic token batches change; accelerate_divisor: "
                                          "accelerate's backward divides the loss by the number of processes too; "
                                          "torch_rand_shift: torch's CPU generator draws one number more before each "
                                          "torch.rand, so every random stream after it shifts; rmsnorm_no_upcast: "
                                          "transformers' LlamaRMSNorm normalises a bf16 input in bf16, without its "
                                          "float32 upcast; rmsnorm_default_eps: transformers' LlamaRMSNorm adds its "
                                          "own default epsilon (1e-6), not the config's",
                                ("rope_interleaved", "lora_rslora", "untied", "numpy_searchsorted",
                                 "accelerate_divisor", "torch_rand_shift", "rmsnorm_no_upcast", "rmsnorm_default_eps")),
              }, required=("mode",), installed_code=True),
    FaultKind("checkpoint", ".checkpoint:install", "a checkpoint bug of docs/faults.md section 3, for scenario checkpoint and "
              "the resume cases of fsdp and lora "
              "(docs/checkpoint.md)", {
        "mode": Param("choice", "optimizer_dropped: the loaded optimizer state is dropped; rank0_shard: only rank 0's "
                                "shard reaches the checkpoint; chunks_permuted: chunks come back in reverse order at "
                                "another world size; tied_key_dropped: the name a tied tensor is stored under is "
                                "dropped on save; untied: every tied name gets its own copy on load; rng_not_restored: "
                                "the generators are not restored; weights_late: loaded weights take effect one step "
                                "late; ulp_nudge: one element of one tensor one ulp up after every load",
                      ("optimizer_dropped", "rank0_shard", "chunks_permuted", "tied_key_dropped", "untied",
                       "rng_not_restored", "weights_late", "ulp_nudge")),
        "layer": Param("int", "ulp_nudge: decoder layer of the nudged weight (default 1)"),
        "proj": Param("choice", "ulp_nudge: projection of the nudged weight (default q_proj)", _PROJECTIONS)},
        required=("mode",), needs_peers=("rank0_shard", "chunks_permuted")),
)}


# What each kind acts on (activities.py), by kind or "kind:mode": a case that runs none of it is not reached, and
# is skipped when only such faults are injected (faults/reach.py). "{op}" and "{path}" take the spec's values
# (each of a list; "*" when it gives none).
ACTS_ON: dict[str, tuple[str, ...]] = {
    "collective": (act.collective("{op}"),),
    # bf16 SUM reductions only: the sweep's all-reduces and reduce-scatters, and bf16 gradient reduce-scatters
    "collective:truncate_bf16": (act.bf16_reduction("{op}"),),
    "emulate_premul_sum": (act.collective("all_reduce"),),  # gloo's all_reduce gains PREMUL_SUM
    "lr_scale": (act.STEP,),
    "slow_step": (act.STEP,),
    "teardown_abort": (act.STEP,),
    "hang": (act.FROM_STEP_0,),  # after a completed step: declared, not measured
    "crash": (act.FROM_STEP_0,),
    "clip": (act.CLIP,),
    "adamw:fused": (act.adamw("fused"),),
    "adamw:foreach": (act.adamw("foreach"),),
    "adamw:single": (act.adamw("single"),),
    "linear_noise": (act.FORWARD, act.LINEAR_ALGEBRA),
    "matmul_ulp": (act.FORWARD, act.LINEAR_ALGEBRA),  # through F.linear too; consensus is where it is caught
    "sdpa_backend": (act.FORWARD,),
    "host_op": (act.FORWARD,),
    "cast": (act.BF16_CAST,),
    "format": (act.FP8_CODECS,),
    "format:loader_fn_as_fnuz": (act.fp8_loader("{path}"),),
    "format:loader_e5m2_as_e4m3fn": (act.e5m2_loader("{path}"),),
    "format:loader_bf16_as_fp16": (act.BF16_READ_BACK,),
    "library:rope_interleaved": (act.LLAMA_FORWARD,),
    "library:lora_rslora": (act.PEFT_LORA,),
    "library:untied": (act.TIED_CONFIG,),
    "library:numpy_searchsorted": (act.SYNTHETIC_TOKENS,),
    "library:accelerate_divisor": (act.ACCELERATE_BACKWARD,),
    "library:torch_rand_shift": (act.RANDOM_STREAMS,),
    "library:rmsnorm_no_upcast": (act.BF16_CAST,),  # bf16 training; fp32 and float64 norms compute as before
    "library:rmsnorm_default_eps": (act.LLAMA_FORWARD,),
    "lora": (act.ADAPTER_SAVE,),
    "lora:rank0_slice": (act.ADAPTER_SHARDS,),
    "checkpoint:optimizer_dropped": (act.OPTIMIZER_STATE_LOAD,),
    "checkpoint:rank0_shard": (act.FULL_STATE_DICT,),
    "checkpoint:chunks_permuted": (act.SHARDED_LOAD,),
    "checkpoint:tied_key_dropped": (act.TIED_SAVE,),
    "checkpoint:untied": (act.TIED_SAVE,),
    "checkpoint:rng_not_restored": (act.RESUME_RESTORE,),
    "checkpoint:weights_late": (act.RESUME_RESTORE,),
    "checkpoint:ulp_nudge": (act.CHECKPOINT_READ,),
}


def acted_on(spec: FaultSpec) -> frozenset[str]:
    """The activities ``spec`` acts on (its ACTS_ON entry: "kind:mode" where the mode has its own, else the kind's),
    its ``op`` and ``path`` filled in."""
    key = f"{spec.kind}:{spec.get('mode')}"
    return activities_of(key if key in ACTS_ON else spec.kind, {name: spec.get(name) for name in ("op", "path")})


def activities_of(key: str, values: dict[str, Any] | None = None) -> frozenset[str]:
    """The activities of the ACTS_ON entry ``key``, with each "{op}" and "{path}" given its ``values`` (a list
    gives one each; none gives "*", every one)."""
    out: set[str] = set()
    for template in ACTS_ON[key]:
        filled = [template]
        for name, value in (values or {}).items():
            given = sorted(value) if isinstance(value, (list, tuple, set, frozenset)) else [value or act.ANY]
            filled = [t.replace("{" + name + "}", str(v)) for t in filled for v in given] \
                if "{" + name + "}" in template else filled
        out.update(t.replace("{op}", act.ANY).replace("{path}", act.ANY) for t in filled)
    return frozenset(out)

def parse(text: str) -> FaultSpec:
    """Parse and validate one spec; BadFaultSpec says what is allowed."""
    kind_name, _, rest = text.partition(":")
    kind = KINDS.get(kind_name.strip())
    if kind is None:
        raise BadFaultSpec(f"{text!r}: unknown fault kind {kind_name.strip()!r}; known kinds: {', '.join(KINDS)}")
    params = dict(_key_value(text, kind, item) for item in filter(None, (p.strip() for p in rest.split(","))))
    missing = [key for key in kind.required if key not in params]
    if missing:
        raise BadFaultSpec(f"{text!r}: fault kind {kind.name!r} needs {', '.join(f'{k}=' for k in missing)} "
                           f"({'; '.join(f'{k} takes {kind.params[k].describe()}' for k in missing)})")
    return FaultSpec(kind.name, params, text)


def _key_value(text: str, kind: FaultKind, item: str) -> tuple[str, Any]:
    """One ``key=value`` of the spec ``text``, read by its kind's schema."""
    key, eq, value = (s.strip() for s in item.partition("="))
    if not eq:
        raise BadFaultSpec(f"{text!r}: {item!r} is not key=value")
    param = kind.params.get(key)
    if param is None:
        allowed = ", ".join(kind.params) or "none"
        raise BadFaultSpec(f"{text!r}: fault kind {kind.name!r} has no key {key!r}; its keys: {allowed}")
    try:
        return key, param.parse(value)
    except ValueError:
        raise BadFaultSpec(f"{text!r}: {key}={value!r} is not allowed; {key} takes {param.describe()}") from None


def parse_all(texts: tuple[str, ...] | list[str]) -> list[FaultSpec]:
    return [parse(t) for t in texts]


def install(texts: list[str], ctx: Any) -> list[str]:
    """On a rank: install every fault in this process; return the specs that apply to this rank."""
    return [firing.spec for firing in install_counted(texts, ctx)]


def install_counted(texts: list[str], ctx: Any) -> list[Firing]:
    """On a rank: install every fault in this process; return the counter of each spec that applies to this rank.
    A collective fault is installed on every rank (its ``ranks`` filter decides where it fires, so the call
    sequence stays the same everywhere); other kinds only on the ranks they name."""
    installed = []
    for spec in parse_all(texts):
        if spec.kind != "collective" and spec.ranks is not None and ctx.rank not in spec.ranks:
            continue
        module, _, function = KINDS[spec.kind].installer.partition(":")
        installer: Callable[[FaultSpec, Any], Firing] = getattr(importlib.import_module(module, __name__), function)
        installed.append(installer(spec, ctx))
    return installed


def needs_peers(spec: FaultSpec) -> bool:
    """True when ``spec`` acts only between ranks: at world size 1 it would never fire."""
    peers = KINDS[spec.kind].needs_peers
    return peers if isinstance(peers, bool) else spec.get("mode") in peers


def check_ranks(specs: tuple[FaultSpec, ...] | list[FaultSpec], world_size: int,
                origin: str = "--gpuregress-world-size") -> None:
    """Refuse a spec that cannot fire with this run's ranks: a green run would claim it was not caught.

    ``origin``: why the run has ``world_size`` ranks, for the message (e.g. "one visible GPU")."""
    for spec in specs:
        if world_size < 2 and needs_peers(spec):
            raise BadFaultSpec(f"{spec.text!r}: needs 2 or more ranks to fire, and this run has {world_size} "
                               f"({origin}); run it on a machine with 2+ GPUs or on the CPU (2 gloo ranks)")
        if spec.ranks is not None and max(spec.ranks) >= world_size:
            raise BadFaultSpec(f"{spec.text!r}: names rank {max(spec.ranks)}, but this run has ranks 0 to "
                               f"{world_size - 1} (--gpuregress-world-size)")
