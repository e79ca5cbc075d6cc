"""The ``--gpuregress-<name>`` options declared below the plugin: ``OptionSpec``, and the built-in scenarios' options.

Neutral (no torch, no pytest), so scenarios declare their options without importing the plugin, and pytest
declares the built-ins' (``SCENARIO_OPTIONS``) at start-up without importing any scenario. Plug-in scenarios
declare theirs on the scenario, read only with --gpuregress.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# flag: on or off (the ini key takes true/false); list: repeatable (one per line in the ini file); csv:
# comma-separated; path: a file or folder, made absolute against the invocation's (or the ini file's) folder.
KINDS = ("flag", "str", "path", "int", "float", "bytes", "list", "csv", "choice")
# What a number of each kind looks like, for the message about one that is not.
_EXAMPLES = {"int": "an integer such as 300", "float": "a number such as 600",
             "bytes": "a size such as 4MiB, 512KiB or 65536"}

# The kinds whose every value converts (the numbers and choices are checked in OptionSpec.convert).
_CONVERT: dict[str, Callable[[Any], Any]] = {
    "flag": bool, "list": list, "str": str, "path": lambda raw: Path(str(raw)),
    "csv": lambda raw: [part.strip() for part in str(raw).split(",") if part.strip()],
}


class BadOptionValue(ValueError):
    """A value that does not fit its option; the message names where it came from and what fits."""


@dataclass(frozen=True)
class OptionSpec:
    """One ``--gpuregress-<name>`` option (``name`` empty: ``--gpuregress`` itself)."""

    name: str
    kind: str  # one of KINDS
    default: Any  # the value when neither the command line nor the ini file sets it
    help: str  # one sentence, lower case, no final full stop: pytest --help shows it, the docs table starts with it
    choices: tuple[str, ...] = ()  # the values a "choice" takes
    minimum: float | None = None  # the accepted range of an int, float or bytes option
    maximum: float | None = None
    ini: str | None = None  # the ini key when it is not the option's name with underscores (a repeatable one's plural)
    metavar: str | None = None  # what the value is (DIR, FILE, SPEC), shown as --gpuregress-x=DIR
    shown_default: str | None = None  # the default in words (markdown), when the value itself does not say it
    details: str = ""  # the docs table's further sentences (markdown), after help
    ini_relative: bool = False  # a path set in the ini file is relative to the ini file's folder, not the invocation's

    def __post_init__(self) -> None:
        # A plug-in's typo fails where it is written, not at the first run that reads the option.
        if self.kind not in KINDS:
            raise ValueError(f"option {self.flag}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"option {self.flag}: a choice option, and only one, lists its choices")
        if "](" in self.help + (self.shown_default or ""):
            raise ValueError(f"option {self.flag}: the terminal shows help and shown_default; put links in details")

    @property
    def flag(self) -> str:
        return f"--gpuregress-{self.name}" if self.name else "--gpuregress"

    @property
    def dest(self) -> str:
        """The argparse destination, e.g. ``gpuregress_collectives_repeats``; scenario values are keyed by it."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def ini_key(self) -> str:
        return self.ini or self.dest

    @property
    def takes_value(self) -> bool:
        return self.kind not in ("flag", "list")

    def default_text(self) -> str:
        """The default in words, as the docs table shows it (markdown)."""
        if self.shown_default is not None:
            return self.shown_default
        if self.kind == "flag":
            return "on" if self.default else "off"
        if self.default in (None, (), []):
            return "none"
        if self.kind == "choice":
            return f"`{self.default}`"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)

    def terminal_help(self) -> str:
        """``help`` for ``pytest --help``: without markdown, with the default of an option that takes a value."""
        text = plain(self.help)
        return f"{text} (default: {plain(self.default_text())})" if self.takes_value else text

    def convert(self, raw: Any, where: str) -> Any:
        """``raw`` (from the command line or the ini file; None: unset) as this option's type; ``where`` names the
        source in the message of ``BadOptionValue``: the flag, or ``ini key x =``."""
        if raw is None:
            return self.default
        if self.kind in _CONVERT:
            return _CONVERT[self.kind](raw)
        if self.kind == "choice":
            if raw not in self.choices:
                raise BadOptionValue(f"{where} {raw!r}: must be one of {', '.join(self.choices)}")
            return raw
        return self._number(str(raw).strip(), raw, where)

    def _number(self, text: str, raw: Any, where: str) -> float:
        try:
            if self.kind == "bytes":
                from .units import parse_bytes  # imported here: only a run that sets a size pays for it

                value: float = parse_bytes(text)
            else:
                value = int(text) if self.kind == "int" else float(text)
        except ValueError:
            raise BadOptionValue(f"{where} {raw!r}: expected {_EXAMPLES[self.kind]}") from None
        if self.minimum is not None and value < self.minimum:
            raise BadOptionValue(f"{where} {raw!r}: must be at least {self.minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise BadOptionValue(f"{where} {raw!r}: must be at most {self.maximum:g}")
        return value


def plain(markdown: str) -> str:
    """A help text's markdown as a terminal shows it: without backticks (it has no links: see __post_init__)."""
    return markdown.replace("`", "")


# --- the built-in scenarios' options ------------------------------------------------------------------

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
