"""The built-in scenarios' own options, declared outside the scenarios package.

pytest declares them all at start-up from this module alone, so a run without --gpuregress imports no
scenario. Plug-in scenarios declare theirs on the scenario, read only with --gpuregress.
"""

from __future__ import annotations

from .option_spec import OptionSpec

LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PROTOCOLS_AND_ALGORITHMS = "See [scenarios.md](scenarios.md#protocols-and-algorithms)."

SCENARIO_OPTIONS: dict[str, tuple[OptionSpec, ...]] = {
    "collectives": (
        OptionSpec("collectives-max-bytes", "bytes", None, "largest buffer in the collective sweep, e.g. `4MiB`",
                   minimum=1, shown_default="4MiB on the CPU, 256MiB on GPUs"),
        OptionSpec("collectives-repeats", "int", 3,
                   "how many times each collective case runs (some faults are intermittent)", minimum=1),
        OptionSpec("nccl-protos", "csv", [], "comma-separated NCCL_PROTO values (`LL,LL128,Simple`): the sweep runs "
                   "once per value, each in its own group of ranks", details=_PROTOCOLS_AND_ALGORITHMS),
        OptionSpec("nccl-algos", "csv", [], "comma-separated NCCL_ALGO values (`Ring,Tree`), crossed with the "
                   "protocols", details=_PROTOCOLS_AND_ALGORITHMS),
    ),
    "formats": (
        OptionSpec("format-changes", "choice", "fail", "an fp8/fp4 overflow, saturation or NaN behaviour that "
                   "differs from the reference: `fail` its case, or `warn` (a warning and a summary line) and pass",
                   choices=("fail", "warn")),
    ),
    "fsdp": (
        OptionSpec("resume-checkpoint", "flag", False, "on GPUs, also record the `fsdp` and `lora` references' resume "
                   "checkpoints and run `fsdp-resume` and `lora-*-resume` (the new stack resumes the reference's "
                   "training from it)",
                   shown_default="off on GPUs; always on the CPU",
                   details="The fsdp checkpoint holds the weights and AdamW's two moments at step `3 * steps // 4`: about 12 "
                   "bytes per parameter, 1.9 GB for the 156 M-parameter GPU model, 1.5 MB for the CPU one; a lora "
                   "checkpoint the frozen base weights (4 bytes per parameter) and the adapter with its moments, about "
                   "0.64 GB on GPUs. See "
                   "[checkpoint.md](checkpoint.md#resume-across-stacks-the-references-own-checkpoint)."),
    ),
    "lora": (
        OptionSpec("lora-targets", "csv", [], "comma-separated module names the `lora` adapter targets",
                   shown_default="every linear projection of the decoder layers",
                   details="Unset, each model targets every `Linear` and `Conv1D` of its decoder layers by leaf name, "
                   "fused ones included (a Phi-3's `qkv_proj`, `gate_up_proj`), never a router, the lm_head or the "
                   f"embeddings; the tiny Llama's are `{','.join(LORA_DEFAULT_TARGETS)}`. The report header names "
                   "each model's targets and what of its blocks was left out. Stored in the reference's config."),
    ),
    "checkpoint": (
        OptionSpec("portable-checkpoint", "str", None, "the `checkpoint` reference folder whose checkpoint "
                   "`-k portability` loads (say one recorded on another vendor's GPUs)", metavar="DIR",
                   shown_default="the shipped CPU bundle"),
        OptionSpec("checkpoint-dir", "str", None, "where the `checkpoint` scenario's temporary checkpoints go, and "
                   "the `fsdp` resume checkpoint while it is recorded (shared storage when ranks span machines); each "
                   "is removed once read", metavar="DIR",
                   shown_default="the system's temporary folder"),
    ),
    "consensus": (
        OptionSpec("consensus", "flag", False, "run every local device's single-device workload at once and vote "
                   "bit for bit within each group of one device model and stack, naming every device that "
                   "differs (scenario `consensus`)", details="With more ranks than one, also the collective sweep "
                   "per link. See [consensus.md](consensus.md)."),
    ),
}
BUILTIN_SCENARIO_OPTIONS = tuple(spec for specs in SCENARIO_OPTIONS.values() for spec in specs)
