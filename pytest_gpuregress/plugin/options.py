"""The plugin's options, each declared once as a field of ``Options`` with its ``OptionSpec``.

The field's name is what the code reads, its annotation the value's type; the spec gives flag, ini key,
parsing, help and the docs/options.md row. Typed fields rather than ``__getattr__`` so type checkers see
them; not a dataclass, whose generated methods cost a third of pytest's start-up. Imports nothing heavy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

import pytest

from ..kinds import DeviceKind, GateMode, KernelChanges, LaneChoice
from ..option_spec import BUILTIN_SCENARIO_OPTIONS, LORA_DEFAULT_TARGETS, SCENARIO_OPTIONS, BadOptionValue, OptionSpec
from ..training.noise import DEFAULT_REPLICAS, PERTURBATIONS

if TYPE_CHECKING:  # read only with --gpuregress: model_specs imports numpy
    from ..faults import FaultSpec
    from ..training.model_specs import ModelSpec

__all__ = ["BUILTIN_SCENARIO_OPTIONS", "CORE_OPTIONS", "ENABLED", "LORA_DEFAULT_TARGETS", "SCENARIO_OPTIONS",
           "OptionSpec", "Options", "add_options", "check_reference_dir_argument", "resolve"]

Then = Callable[[Any, Path], Any]  # (the option's value, the folder its relative paths start from) -> the field's


class Declared(NamedTuple):
    """What an ``Options`` field is declared with: its option, and how its value follows from the option's."""

    spec: OptionSpec
    then: Then | None


def option(spec: OptionSpec, then: Then | None = None) -> Any:
    """An ``Options`` field declared by its option; its default is the option's. ``then`` computes the field's
    value from the option's, when they differ (typed ``Any``, like ``dataclasses.field``, so the annotation rules)."""
    return Declared(spec, then)


def _models(values: list[str], base: Path) -> tuple[ModelSpec, ...]:
    """--gpuregress-model values (relative to the invocation), else gpuregress_models (relative to the ini file)."""
    from ..errors import BadModel
    from ..training.model_specs import parse_models

    try:
        return parse_models(list(values), base)
    except BadModel as exc:
        raise pytest.UsageError(str(exc)) from None


class Options:
    """This session's option values, read-only (all defaults when --gpuregress is off). The fields' order is the
    docs'. ``Options(steps=8)`` sets some and leaves the rest at their defaults."""

    enabled: bool = option(OptionSpec(
        "", "flag", False, "add the built-in suite to the tests pytest collects and enable the `gpuregress` fixture",
        details="The project's own tests are collected as always; the built-in cases join under the node id "
        "`gpuregress` when no test path is given (`testpaths`, or the folder pytest runs in). Name them among "
        "paths with `gpuregress` or `gpuregress::<case>`; select them with `-k`, `-m gpuregress_training`, "
        "`--lf`. Without the flag the plugin adds nothing, skips its tests and imports no torch."))
    no_builtin: bool = option(OptionSpec(
        "no-builtin", "flag", False, "leave the built-in suite out: only the project's own tests run (its own loops "
        "and metrics), unless `gpuregress` is named among the paths"))
    record: bool = option(OptionSpec(
        "record", "flag", False, "write (or overwrite) references from this run instead of comparing"))
    record_anyway: bool = option(OptionSpec(
        "record-anyway", "flag", False, "with --gpuregress-record: replace a reference even where this run's step 0 is "
        "further from float64 than the reference's, which is refused otherwise (a stack that got worse)"))
    record_missing: bool = option(OptionSpec(
        "record-missing", "flag", False, "record the references that do not exist yet where this run reads them "
        "(a first run on a new platform, say a new GPU model) and compare with the rest; it never overwrites one"))
    reference_dir: Path | None = option(OptionSpec(
        "reference-dir", "path", None, "where references are read and recorded", metavar="DIR",
        shown_default="`<rootdir>/reference_runs`, then the shipped references",
        details="Write it with `=`: pytest picks its rootdir before plugins load, and the plugin stops with a clear "
        "message if a two-word form moved it."))
    device: DeviceKind | Literal["auto"] = option(OptionSpec(
        "device", "choice", "auto", "`cpu`, or `cuda` (which covers ROCm builds of torch too); `auto` takes `cuda` "
        "when torch sees a GPU", choices=("auto", *get_args(DeviceKind))))
    world_size: int | None = option(OptionSpec(
        "world-size", "int", None, "number of ranks to spawn", minimum=1,
        shown_default="one rank per GPU, or 2 on the CPU"))
    steps: int | None = option(OptionSpec(
        "steps", "int", None, "training steps", minimum=1, shown_default="the scenario's (300)",
        details="A reference recorded with other steps is refused as foreign."))
    timeout: float = option(OptionSpec(
        "timeout", "float", 600.0, "wall-clock seconds one group of ranks may take", minimum=1,
        details="A hang fails that test with the rank, its last completed step and its Python stack, and the "
        "session goes on."))
    lane: LaneChoice = option(OptionSpec(
        "lane", "choice", "auto", "the comparison lane: `exact` (bit for bit) or `tolerant` (within the recorded "
        "noise); `auto` takes `exact` when the stack's numerics fingerprint matches the reference's",
        choices=get_args(LaneChoice), details="See [envelope.md](envelope.md)."))
    inject: tuple[str, ...] = option(OptionSpec(
        "inject", "list", (), "inject a fault into every rank, to prove the detectors fire on your stack; "
        "repeatable", metavar="SPEC",
        details="Specs are checked before any rank starts; the kinds and their keys are in "
        "`pytest_gpuregress/faults/__init__.py`, the bug classes they emulate in [faults.md](faults.md)."),
        lambda values, base: tuple(values))
    replicas: int = option(OptionSpec(
        "replicas", "int", DEFAULT_REPLICAS, f"noise replicas run when recording a training reference (0 to "
        f"{len(PERTURBATIONS)}; 0 records no envelope); their spread sets the tolerant lane's limits",
        minimum=0, maximum=len(PERTURBATIONS), details="See [the noise envelope](envelope.md#the-noise-envelope)."))
    models: tuple[ModelSpec, ...] = option(OptionSpec(
        "model", "list", (), "a model every training scenario also runs: a transformers config file (or the folder "
        "holding `config.json`), a zoo model by name (`tiny-moe`), or `package.module:function`, a factory "
        "returning the model; repeatable", ini="gpuregress_models", metavar="PATH", ini_relative=True,
        details="The training scenarios are `fsdp`, both `lora` cases, triage's equivalence and oracle, "
        "`checkpoint` (full-state-dict, resharding, resume) and the quantized checkpoints of `formats`; a factory "
        "is described in [own-models.md](own-models.md#a-model-from-a-factory). The file's stem (or the function's "
        "name) names its cases (`fsdp-tiny-qwen2`, `-k \"tiny-qwen2 and fsdp\"`) and its references "
        "(`reference_runs/fsdp-tiny-qwen2/`). A config transformers cannot build, a factory that cannot be "
        "imported, a missing file or a model whose weights, gradients and AdamW state exceed the device's memory "
        "stops the session naming it; a model without any of the names given in `--gpuregress-lora-targets` (or, "
        "without it, without a `Linear` or `Conv1D` in its decoder layers) skips `lora` and says which option "
        "fixes it."), _models)
    tokens: Path | None = option(OptionSpec(
        "tokens", "path", None, "a `.npy` or `.safetensors` file of token ids (a sample of your own traffic) that "
        "your models (--gpuregress-model) train on in `fsdp`, `lora`, `checkpoint` and triage instead of the "
        "synthetic Markov data; the built-in models keep theirs", metavar="FILE",
        shown_default="the synthetic data", ini_relative=True,
        details="Read as one stream: step s, sample i takes window s x batch + i (wrapping), so batches stay fixed "
        "per step and shard by rank as before. Its sha256 goes into the stored config, so it gets references of its "
        "own; a missing file, non-integer ids or an id outside a model's vocabulary (named) stop the session before "
        "any rank starts, and so does the option without --gpuregress-model. Never unpickled."))
    known_issues: Path | None = option(OptionSpec(
        "known-issues", "path", None, "a TOML file of your own known stack issues, matched against this stack like "
        "the shipped ones", metavar="FILE", ini_relative=True, details="See [known_issues.md](known_issues.md)."))
    kernel_changes: KernelChanges = option(OptionSpec(
        "kernel-changes", "choice", "report", "kernels that changed since the reference (profiled over a few steps "
        "of each training scenario): `report` them (a warning), `fail` on them, or take no inventory (`off`)",
        choices=get_args(KernelChanges),
        details="See [scenarios.md](scenarios.md#kernels-throughput-and-memory)."))
    perf: GateMode = option(OptionSpec(
        "perf", "choice", "warn", "step time, tokens/s, peak memory and bus bandwidth past their limits against "
        "the reference: `warn`, `fail`, or do not compare (`off`)", choices=get_args(GateMode)))
    perf_slowdown: float = option(OptionSpec(
        "perf-slowdown", "float", 1.5, "how many times the reference's step time counts as a slowdown", minimum=1))
    perf_memory: float = option(OptionSpec(
        "perf-memory", "float", 1.3, "how many times the reference's peak memory counts as a regression",
        minimum=1))
    triage: bool = option(OptionSpec(
        "triage", "flag", False, "on a failing training scenario, re-run it with one switch flipped at a time "
        "(NCCL protocol and algorithm, BLAS, SDPA backend, reduced precision; on the CPU its kernel set and the world "
        "size) to name the component",
        details="See [triage.md](triage.md#triage-which-component-with-evidence)."))
    bisect: bool = option(OptionSpec(
        "bisect", "flag", False, "on a failing training scenario, revert the packages that changed since the "
        "reference (in overlays, never in your environment) and rerun step 0, halving the set each time, to name the "
        "package whose revert restores step 0",
        details="Torch and what is built against it, editable or local installs and versions with no wheel are not "
        "tested, and the report says so. See [triage.md](triage.md#bisect-an-upgrade-to-the-package)."))
    wheelhouse: Path | None = option(OptionSpec(
        "wheelhouse", "path", None, "with --gpuregress-bisect: a folder of wheels the reference's versions are "
        "installed from, first (for clusters without a package index); pip's configured index is the fallback",
        metavar="DIR"))
    keep_runs: bool = option(OptionSpec(
        "keep-runs", "flag", False, "keep the rank logs and records of runs that passed too (those of failed runs "
        "are always kept)"))
    artifacts: Path | None = option(OptionSpec(
        "artifacts", "path", None, "where a run leaves what is read later: failed runs' records in the store's "
        "format, plots, rank logs", metavar="DIR",
        shown_default="`.pytest_cache/d/gpuregress-runs` (a temporary folder without the cache)",
        details="Named in the report header, so CI can upload it."))
    plots: bool = option(OptionSpec(
        "plots", "flag", False, "draw the comparison plot for every training run, not only for failed ones",
        details="Needs `pip install 'pytest-gpuregress[plots]'`."))
    fail_fast: bool = option(OptionSpec(
        "fail-fast", "flag", False, "compare each training step with the reference while it runs (loss and "
        "gradient norm, against the tolerant lane's limits) and stop at the first step outside them",
        details="The failure names that step; the comparison covers the steps that ran."))
    fresh_ranks: bool = option(OptionSpec(
        "fresh-ranks", "flag", False, "start new rank processes for every launch instead of reusing the session's "
        "pool of ranks (slower; for debugging)"))
    # Not an option: a scenario's own options' values, by dest (gpuregress_collectives_repeats), validated alike.
    scenario_values: dict[str, Any]

    def __init__(self, **values: Any) -> None:
        unknown = sorted(set(values) - set(FIELDS) - {"scenario_values"})
        if unknown:
            raise TypeError(f"Options has no field {', '.join(unknown)}; its fields: {', '.join(FIELDS)}")
        for name, declared in FIELDS.items():
            object.__setattr__(self, name, values.get(name, declared.spec.default))
        object.__setattr__(self, "scenario_values", dict(values.get("scenario_values") or {}))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Options are read-only: cannot set {name}")

    def __eq__(self, other: object) -> bool:
        names = [*FIELDS, "scenario_values"]
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in names)

    __hash__ = None  # type: ignore[assignment]  # equal by value, and scenario_values is a dict

    def __repr__(self) -> str:
        changed = [f"{name}={getattr(self, name)!r}" for name, declared in FIELDS.items()
                   if getattr(self, name) != declared.spec.default]
        if self.scenario_values:
            changed.append(f"scenario_values={self.scenario_values!r}")
        return f"Options({', '.join(changed)})"

    @cached_property
    def faults(self) -> tuple[FaultSpec, ...]:
        """The --gpuregress-inject specs, parsed (from_config has checked them)."""
        from ..faults import parse_all

        return tuple(parse_all(self.inject))

    @classmethod
    def from_config(cls, config: pytest.Config, scenario_specs: Iterable[OptionSpec] = ()) -> Options:
        if not resolve(config, ENABLED):  # off: the other values are not read, so not judged
            return cls()
        from ..errors import BadFaultSpec

        values = {name: _value(config, *declared) for name, declared in FIELDS.items()}
        options = cls(**values, scenario_values={spec.dest: resolve(config, spec) for spec in scenario_specs})
        try:
            options.faults  # noqa: B018 - parsed now, so a bad spec stops the session before any rank starts
        except BadFaultSpec as exc:
            raise pytest.UsageError(f"--gpuregress-inject: {exc}") from None
        return options


# Each field of Options by name, in declaration order; the class attribute stays the declaration.
FIELDS: dict[str, Declared] = {name: value for name, value in vars(Options).items() if isinstance(value, Declared)}
CORE_OPTIONS: tuple[OptionSpec, ...] = tuple(declared.spec for declared in FIELDS.values())
ENABLED = CORE_OPTIONS[0]  # --gpuregress itself


def add_options(parser: pytest.Parser, specs: Iterable[OptionSpec]) -> None:
    """Each option on the command line and as an ini key, in the "gpuregress" group of ``pytest --help``."""
    group = parser.getgroup("gpuregress", "training-stack numerics regression (pytest-gpuregress)")
    for spec in specs:
        text = spec.terminal_help()
        if spec.kind == "flag":
            group.addoption(spec.flag, action="store_true", default=None, dest=spec.dest, help=text)
            parser.addini(spec.ini_key, help=text, type="bool", default=spec.default)
        elif spec.kind == "list":
            group.addoption(spec.flag, action="append", default=None, dest=spec.dest,
                            metavar=spec.metavar or "VALUE", help=text)
            parser.addini(spec.ini_key, help=text, type="linelist", default=list(spec.default))
        else:
            # No argparse type or choices: our own conversion gives the one-line message for both sources.
            metavar = spec.metavar or ("|".join(spec.choices) if spec.choices else spec.kind.upper())
            group.addoption(spec.flag, action="store", default=None, dest=spec.dest, metavar=metavar, help=text)
            parser.addini(spec.ini_key, help=text, default=None)


def resolve(config: pytest.Config, spec: OptionSpec) -> Any:
    """The option's value: command line, else ini key, else default; converted, checked, a path made absolute."""
    cli = config.getoption(spec.dest)
    if cli is not None:
        raw, where = cli, spec.flag
    else:
        ini = config.getini(spec.ini_key)
        raw, where = (None if ini in (None, "", []) else ini), f"ini key {spec.ini_key} ="
    try:
        value = spec.convert(raw, where)
    except BadOptionValue as exc:
        raise pytest.UsageError(str(exc)) from None
    if spec.kind == "path" and value is not None:
        value = (_base_of(config, spec) / value).resolve()
    return value


def _value(config: pytest.Config, spec: OptionSpec, then: Then | None) -> Any:
    value = resolve(config, spec)
    return value if then is None else then(value, _base_of(config, spec))


def _base_of(config: pytest.Config, spec: OptionSpec) -> Path:
    """What an option's relative paths start from: the invocation folder, unless the option says the ini file's
    folder and came from there."""
    from_ini = spec.ini_relative and config.getoption(spec.dest) is None
    return config.inipath.parent if from_ini and config.inipath is not None else config.invocation_params.dir


def check_reference_dir_argument(config: pytest.Config) -> None:
    """Fail clearly when ``--gpuregress-reference-dir DIR`` (two words) moved pytest's rootdir.

    pytest picks its rootdir before plugins add options, so it takes DIR for a test path; recompute without it."""
    args = list(config.invocation_params.args)
    if "--gpuregress-reference-dir" not in args[:-1]:
        return
    value = args[args.index("--gpuregress-reference-dir") + 1]
    if (config.invocation_params.dir / value).is_dir() and _rootdir_now(config) != (config.rootpath, config.inipath):
        raise pytest.UsageError(
            f"--gpuregress-reference-dir {value}: pytest took the directory for a test path while choosing "
            f"its rootdir ({config.rootpath}) and ini file ({config.inipath}), before this plugin was loaded. "
            f"Write it as one word: --gpuregress-reference-dir={value}"
        )


def _rootdir_now(config: pytest.Config) -> tuple[Path | None, Path | None]:
    """(rootdir, ini file) as pytest chooses them now that it knows the option and so its value; (None, None)
    where its private API cannot tell."""
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
        return None, None
    return rootpath, inipath
