"""Command-line options and their ini keys: declared once, typed, validated, resolved into one dataclass.

Each ``--gpuregress-foo-bar`` option has the ini key ``gpuregress_foo_bar``; the command line wins.
A scenario may declare options of its own (``Scenario.options``); they are added to the same
group and reach the scenario, validated, through ``Setup.option``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..errors import BadFaultSpec, BadModel
from ..faults import FaultSpec, parse_all
from ..training.noise import DEFAULT_REPLICAS, PERTURBATIONS
from ..units import parse_bytes

if TYPE_CHECKING:  # model_specs imports numpy: only a run with --gpuregress reads models
    from ..training.model_specs import ModelSpec


@dataclass(frozen=True)
class OptionSpec:
    """One ``--gpuregress-<name>`` option.

    kind: flag | str | int | float | bytes | list (repeatable) | csv (comma-separated) | choice
    minimum: the smallest accepted number (int, float and bytes kinds)
    """

    name: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    ini: str | None = None  # the ini key when it is not the option's name (a repeatable option's plural)

    @property
    def ini_key(self) -> str:
        return self.ini or self.dest

    @property
    def flag(self) -> str:
        return f"--gpuregress-{self.name}" if self.name else "--gpuregress"

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def convert(self, raw: Any, where: str) -> Any:
        """``raw`` (a string from the command line or ini file) as this option's type, or a UsageError."""
        if raw is None:
            return self.default
        if self.kind in ("flag", "list"):
            return raw
        if self.kind == "csv":
            return [p.strip() for p in str(raw).split(",") if p.strip()]
        if self.kind == "choice":
            if raw not in self.choices:
                raise pytest.UsageError(f"{where} {raw!r}: must be one of {', '.join(self.choices)}")
            return raw
        if self.kind == "str":
            return str(raw)
        parse: Callable[[str], float] = {"int": int, "float": float, "bytes": parse_bytes}[self.kind]
        try:
            value = parse(str(raw).strip())
        except ValueError:
            example = {"int": "an integer such as 300", "float": "a number such as 600",
                       "bytes": "a size such as 4MiB, 512KiB or 65536"}[self.kind]
            raise pytest.UsageError(f"{where} {raw!r}: expected {example}") from None
        if self.minimum is not None and value < self.minimum:
            raise pytest.UsageError(f"{where} {raw!r}: must be at least {self.minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise pytest.UsageError(f"{where} {raw!r}: must be at most {self.maximum:g}")
        return value


CORE_OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec("", "flag", False, "run the built-in regression suite and enable the gpuregress fixtures"),
    OptionSpec("record", "flag", False, "write (or overwrite) references from this run instead of comparing"),
    OptionSpec("record-missing", "flag", False, "record the references that do not exist yet (a first run on a new "
               "platform) and compare with the rest; never overwrites one"),
    OptionSpec("reference-dir", "str", None,
               "directory of references to compare against and record into (default: <rootdir>/reference_runs, "
               "falling back to the references shipped with the plugin)"),
    OptionSpec("device", "choice", "auto", "cuda also covers ROCm builds of torch", choices=("auto", "cpu", "cuda")),
    OptionSpec("world-size", "int", None, "ranks to spawn (default: one per local GPU, or 2 on the CPU)", minimum=1),
    OptionSpec("steps", "int", None, "training steps (default: the scenario's, 300 for fsdp)", minimum=1),
    OptionSpec("timeout", "float", 600.0, "wall-clock seconds one group of ranks may take before it is reported "
                                          "as hung and killed", minimum=1),
    OptionSpec("lane", "choice", "auto", "comparison lane: exact (bitwise) when the numerics fingerprint matches, "
                                         "tolerant otherwise", choices=("auto", "exact", "tolerant")),
    OptionSpec("inject", "list", [], "inject a fault into every rank, to prove a detector fires "
                                     "(see docs/faults.md); repeatable"),
    OptionSpec("triage", "flag", False, "on a failing training scenario, re-run it with one switch flipped at a "
                                        "time (protocol, BLAS, SDPA, CPU kernels, world size) to name the component"),
    OptionSpec("keep-runs", "flag", False, "keep every run's rank logs and records (kept on failure anyway)"),
    OptionSpec("artifacts", "str", None, "folder for what a run leaves to read later: failed runs' records "
                                         "(the store's format), plots, rank logs (default: pytest's cache, "
                                         ".pytest_cache/d/gpuregress-runs)"),
    OptionSpec("plots", "flag", False, "draw the comparison plot for every training run, not only failed ones "
                                       "(needs pytest-gpuregress[plots])"),
    OptionSpec("fail-fast", "flag", False, "compare each training step with the reference as it runs, and stop "
                                           "at the first step outside the tolerant lane's limits"),
    OptionSpec("fresh-ranks", "flag", False, "start new rank processes for every launch instead of reusing a pool "
                                             "of ranks across launches (slower; for debugging the pool)"),
    OptionSpec("replicas", "int", DEFAULT_REPLICAS,
               "noise replicas run when recording a training reference; their spread sets the tolerant lane's "
               f"limits (0 to {len(PERTURBATIONS)}; 0 records no envelope)", minimum=0, maximum=len(PERTURBATIONS)),
    OptionSpec("kernel-changes", "choice", "report",
               "kernels that changed since the reference (profiled over a few steps of each training scenario): "
               "report them, fail on them, or take no inventory (off)", choices=("report", "fail", "off")),
    OptionSpec("perf", "choice", "warn", "step time, tokens/s, peak memory and bus bandwidth past their limits "
                                         "against the reference: warn, fail, or do not compare (off)",
               choices=("warn", "fail", "off")),
    OptionSpec("perf-slowdown", "float", 1.5, "how many times slower than the reference counts as a slowdown",
               minimum=1),
    OptionSpec("perf-memory", "float", 1.3, "how many times the reference's peak memory counts as a regression",
               minimum=1),
    OptionSpec("model", "list", [], "a transformers config file (or its folder) of a model every training scenario "
                                    "runs too, named by the file's stem in test ids and references; repeatable",
               ini="gpuregress_models"),
    OptionSpec("tokens", "str", None, "a .npy or .safetensors file of token ids the training scenarios train on "
                                      "instead of the synthetic data (a sample of your own traffic)"),
    OptionSpec("known-issues", "str", None, "a TOML file of your own known stack issues, matched against this "
                                            "stack like the shipped ones (docs/known_issues.md)"),
)

LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The built-in scenarios' own options (each scenario's ``options``), kept here so that pytest declares them
# without importing a scenario module: a run without --gpuregress imports none. Plug-in scenarios declare
# theirs on the scenario; those are read only with --gpuregress.
SCENARIO_OPTIONS: dict[str, tuple[OptionSpec, ...]] = {
    "collectives": (
        OptionSpec("collectives-max-bytes", "bytes", None,
                   "largest collective buffer in the sweep, e.g. 4MiB (default: 4MiB on the CPU, 256MiB on GPUs)",
                   minimum=1),
        OptionSpec("collectives-repeats", "int", 3, "times each collective case runs; some faults are intermittent",
                   minimum=1),
        OptionSpec("nccl-protos", "csv", [], "comma-separated NCCL_PROTO values (LL,LL128,Simple): the sweep runs "
                                             "once per value, each in its own group of ranks"),
        OptionSpec("nccl-algos", "csv", [], "comma-separated NCCL_ALGO values (Ring,Tree), crossed with the protocols"),
    ),
    "formats": (
        OptionSpec("format-changes", "choice", "fail",
                   "a format behaviour (saturation, NaN, inf on overflow) that differs from the reference: "
                   "fail its case, or warn and pass", choices=("fail", "warn")),
    ),
    "lora": (
        OptionSpec("lora-targets", "csv", [], "comma-separated module names the LoRA adapter targets "
                   f"(default: {','.join(LORA_DEFAULT_TARGETS)})"),
    ),
    "checkpoint": (
        OptionSpec("portable-checkpoint", "str", None, "the reference folder of the checkpoint scenario whose "
                   "checkpoint the portability case loads (default: the shipped one, recorded on the CPU)"),
        OptionSpec("checkpoint-dir", "str", None, "where the checkpoint scenario's temporary checkpoint folders go; "
                   "shared storage when ranks span machines (default: the system's temporary folder)"),
    ),
}
BUILTIN_SCENARIO_OPTIONS = tuple(spec for specs in SCENARIO_OPTIONS.values() for spec in specs)


def add_options(parser: pytest.Parser, specs: Iterable[OptionSpec]) -> None:
    group = parser.getgroup("gpuregress", "training-stack numerics regression (pytest-gpuregress)")
    for spec in specs:
        if spec.kind == "flag":
            group.addoption(spec.flag, action="store_true", default=None, dest=spec.dest, help=spec.help)
            parser.addini(spec.ini_key, help=spec.help, type="bool", default=spec.default)
        elif spec.kind == "list":
            group.addoption(spec.flag, action="append", default=None, dest=spec.dest, metavar="SPEC", help=spec.help)
            parser.addini(spec.ini_key, help=spec.help, type="linelist", default=spec.default)
        else:
            # No argparse type or choices: our own conversion gives the one-line message for both sources.
            metavar = "|".join(spec.choices) if spec.choices else spec.kind.upper()
            group.addoption(spec.flag, action="store", default=None, dest=spec.dest, metavar=metavar,
                            help=f"{spec.help} (default: {spec.default})")
            parser.addini(spec.ini_key, help=spec.help, default=None)


def resolve(config: pytest.Config, spec: OptionSpec) -> Any:
    """The option's value: command line, else ini key, else default; converted and validated."""
    cli = config.getoption(spec.dest)
    if cli is not None:
        return spec.convert(cli, spec.flag)
    ini = config.getini(spec.ini_key)
    if spec.kind in ("flag", "list"):
        return ini if ini not in (None, "") else spec.default
    return spec.convert(None if ini in (None, "") else ini, f"ini key {spec.ini_key} =")


@dataclass(frozen=True)
class Options:
    enabled: bool = False
    record: bool = False
    record_missing: bool = False
    reference_dir: Path | None = None
    device: str = "auto"
    world_size: int | None = None
    steps: int | None = None
    timeout: float = 600.0
    lane: str = "auto"
    inject: tuple[str, ...] = ()
    faults: tuple[FaultSpec, ...] = ()
    keep_runs: bool = False
    fresh_ranks: bool = False
    artifacts: Path | None = None
    plots: bool = False
    fail_fast: bool = False
    triage: bool = False
    replicas: int = DEFAULT_REPLICAS
    kernel_changes: str = "report"
    perf: str = "warn"
    perf_slowdown: float = 1.5
    perf_memory: float = 1.3
    known_issues: Path | None = None
    tokens: Path | None = None
    models: tuple[ModelSpec, ...] = ()
    # A scenario's own options, by dest (e.g. gpuregress_collectives_repeats); validated like the rest.
    scenario_values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: pytest.Config, scenario_specs: Iterable[OptionSpec] = ()) -> Options:
        if not resolve(config, CORE_OPTIONS[0]):  # off: the other values are not read, so not judged
            return cls()
        values = {spec.dest: resolve(config, spec) for spec in CORE_OPTIONS}
        inject = tuple(values["gpuregress_inject"] or ())
        try:
            faults = tuple(parse_all(inject))
        except BadFaultSpec as exc:
            raise pytest.UsageError(f"--gpuregress-inject: {exc}") from None
        ref = values["gpuregress_reference_dir"]
        return cls(
            enabled=True,
            record=bool(values["gpuregress_record"]),
            record_missing=bool(values["gpuregress_record_missing"]),
            reference_dir=(config.invocation_params.dir / ref).resolve() if ref else None,
            device=values["gpuregress_device"],
            world_size=values["gpuregress_world_size"],
            steps=values["gpuregress_steps"],
            timeout=float(values["gpuregress_timeout"]),
            lane=values["gpuregress_lane"],
            inject=inject,
            faults=faults,
            keep_runs=bool(values["gpuregress_keep_runs"]),
            fresh_ranks=bool(values["gpuregress_fresh_ranks"]),
            artifacts=(config.invocation_params.dir / values["gpuregress_artifacts"]).resolve()
            if values["gpuregress_artifacts"] else None,
            plots=bool(values["gpuregress_plots"]),
            fail_fast=bool(values["gpuregress_fail_fast"]),
            triage=bool(values["gpuregress_triage"]),
            replicas=int(values["gpuregress_replicas"]),
            kernel_changes=values["gpuregress_kernel_changes"],
            perf=values["gpuregress_perf"],
            perf_slowdown=float(values["gpuregress_perf_slowdown"]),
            perf_memory=float(values["gpuregress_perf_memory"]),
            known_issues=_ini_relative_path(config, "gpuregress_known_issues", values["gpuregress_known_issues"]),
            tokens=_ini_relative_path(config, "gpuregress_tokens", values["gpuregress_tokens"]),
            models=_models(config, values["gpuregress_model"]),
            scenario_values={spec.dest: resolve(config, spec) for spec in scenario_specs},
        )


def _models(config: pytest.Config, values: list[str]) -> tuple[ModelSpec, ...]:
    """--gpuregress-model values (relative to the invocation), else gpuregress_models (relative to the ini file)."""
    from ..training.model_specs import parse_models

    try:
        return parse_models(list(values or ()), _base_of(config, "gpuregress_model"))
    except BadModel as exc:
        raise pytest.UsageError(str(exc)) from None


def _ini_relative_path(config: pytest.Config, dest: str, value: str | None) -> Path | None:
    """A file option's path: relative to the ini file's folder when set there, else to the invocation."""
    if not value:
        return None
    return (_base_of(config, dest) / value).resolve()


def _base_of(config: pytest.Config, dest: str) -> Path:
    """What an option's relative paths are relative to: the invocation folder when it came from the command
    line (or there is no ini file), else the ini file's folder."""
    from_cli = config.getoption(dest) is not None
    return config.invocation_params.dir if from_cli or config.inipath is None else config.inipath.parent


def check_reference_dir_argument(config: pytest.Config) -> None:
    """Fail clearly when ``--gpuregress-reference-dir DIR`` (two words) moved pytest's rootdir.

    pytest chooses its rootdir and ini file before plugins add their options, so it takes an
    existing DIR after an option it does not know yet for a test path. ``--opt=DIR`` is one word
    and is safe. Here we recompute the choice without DIR and stop if it differs.
    """
    args = list(config.invocation_params.args)
    if "--gpuregress-reference-dir" not in args[:-1]:
        return
    value = args[args.index("--gpuregress-reference-dir") + 1]
    if not (config.invocation_params.dir / value).is_dir():
        return
    from _pytest.config.findpaths import determine_setup

    wanted = {
        "inifile": config.option.inifilename,
        "override_ini": config.option.override_ini,
        "args": [str(a) for a in config.option.file_or_dir or []],
        "rootdir_cmd_arg": config.option.rootdir or None,
        "invocation_dir": config.invocation_params.dir,
    }
    params = inspect.signature(determine_setup).parameters
    try:
        rootpath, inipath = determine_setup(**{k: v for k, v in wanted.items() if k in params})[:2]
    except Exception:  # noqa: BLE001 - private API; when in doubt, ask for the safe spelling
        rootpath, inipath = None, None
    if (rootpath, inipath) != (config.rootpath, config.inipath):
        raise pytest.UsageError(
            f"--gpuregress-reference-dir {value}: pytest took the directory for a test path while choosing "
            f"its rootdir ({config.rootpath}) and ini file ({config.inipath}), before this plugin was loaded. "
            f"Write it as one word: --gpuregress-reference-dir={value}"
        )
