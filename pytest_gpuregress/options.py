"""Command-line options and their ini keys, declared once and resolved into one dataclass.

Each ``--gpuregress-foo-bar`` option has the ini key ``gpuregress_foo_bar``; the command line wins.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# (option, kind, default, help). kind: flag | str | int | float | list | choice:<a|b|c>
OPTIONS: list[tuple[str, str, Any, str]] = [
    ("--gpuregress", "flag", False, "run the built-in regression suite and enable the gpuregress fixtures"),
    ("--gpuregress-record", "flag", False, "write (or overwrite) references from this run instead of comparing"),
    ("--gpuregress-reference-dir", "str", None,
     "directory of references to compare against and record into (default: <rootdir>/reference_runs, "
     "falling back to the references shipped with the plugin)"),
    ("--gpuregress-device", "choice:auto|cpu|cuda", "auto", "cuda also covers ROCm builds of torch"),
    ("--gpuregress-world-size", "int", None, "ranks to spawn (default: one per local GPU, or 2 on the CPU)"),
    ("--gpuregress-steps", "int", None, "training steps (default: the scenario's, 300 for fsdp)"),
    ("--gpuregress-timeout", "float", 600.0, "wall-clock seconds one group of ranks may take before it is "
                                              "reported as hung and killed"),
    ("--gpuregress-lane", "choice:auto|exact|tolerant", "auto",
     "comparison lane: exact (bitwise) when the numerics fingerprint matches, tolerant otherwise"),
    ("--gpuregress-inject", "list", [], "inject a fault into every rank, to prove a detector fires "
                                         "(see pytest_gpuregress/faults.py); repeatable"),
    ("--gpuregress-keep-runs", "flag", False, "keep every run's rank logs and records (kept on failure anyway)"),
    ("--gpuregress-collectives-max-bytes", "str", None,
     "largest collective buffer in the sweep, e.g. 4MiB (default: 4MiB on the CPU, 256MiB on GPUs)"),
    ("--gpuregress-collectives-repeats", "int", 3, "times each collective case runs; some faults are intermittent"),
    ("--gpuregress-nccl-protos", "str", "", "comma-separated NCCL_PROTO values (LL,LL128,Simple): the sweep runs "
                                             "once per value, each in its own group of ranks"),
    ("--gpuregress-nccl-algos", "str", "", "comma-separated NCCL_ALGO values (Ring,Tree), crossed with the protocols"),
]


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpuregress", "training-stack numerics regression (pytest-gpuregress)")
    for option, kind, default, help_text in OPTIONS:
        dest = _dest(option)
        if kind == "flag":
            group.addoption(option, action="store_true", default=None, dest=dest, help=help_text)
            parser.addini(dest, help=help_text, type="bool", default=default)
        elif kind == "list":
            group.addoption(option, action="append", default=None, dest=dest, metavar="SPEC", help=help_text)
            parser.addini(dest, help=help_text, type="linelist", default=default)
        else:
            choices = kind.split(":", 1)[1].split("|") if kind.startswith("choice:") else None
            group.addoption(option, action="store", default=None, dest=dest, choices=choices,
                            metavar=None if choices else kind.upper(), help=f"{help_text} (default: {default})")
            parser.addini(dest, help=help_text, default=None)


def _value(config: pytest.Config, option: str, kind: str, default: Any) -> Any:
    dest = _dest(option)
    cli = config.getoption(dest)
    if cli is not None:
        return cli
    ini = config.getini(dest)
    if kind in ("flag", "list"):
        return ini if ini not in (None, "") else default
    if ini in (None, ""):
        return default
    try:
        return {"int": int, "float": float}.get(kind, str)(ini)
    except ValueError:
        raise pytest.UsageError(f"ini key {dest} = {ini!r}: expected {kind}") from None


@dataclass(frozen=True)
class Options:
    enabled: bool = False
    record: bool = False
    reference_dir: Path | None = None
    device: str = "auto"
    world_size: int | None = None
    steps: int | None = None
    timeout: float = 600.0
    lane: str = "auto"
    inject: list[str] = field(default_factory=list)
    keep_runs: bool = False
    collectives_max_bytes: str | None = None
    collectives_repeats: int = 3
    nccl_protos: list[str] = field(default_factory=list)
    nccl_algos: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: pytest.Config) -> Options:
        values = {_dest(opt): _value(config, opt, kind, default) for opt, kind, default, _ in OPTIONS}
        kind_of = {_dest(opt): kind for opt, kind, _, _ in OPTIONS}
        for name in ("gpuregress_device", "gpuregress_lane"):
            allowed = kind_of[name].split(":", 1)[1].split("|")
            if values[name] not in allowed:
                raise pytest.UsageError(f"{name} = {values[name]!r}: must be one of {allowed}")
        ref = values["gpuregress_reference_dir"]
        return cls(
            enabled=bool(values["gpuregress"]),
            record=bool(values["gpuregress_record"]),
            reference_dir=(config.invocation_params.dir / ref).resolve() if ref else None,
            device=values["gpuregress_device"],
            world_size=int(values["gpuregress_world_size"]) if values["gpuregress_world_size"] else None,
            steps=int(values["gpuregress_steps"]) if values["gpuregress_steps"] else None,
            timeout=float(values["gpuregress_timeout"]),
            lane=values["gpuregress_lane"],
            inject=list(values["gpuregress_inject"] or []),
            keep_runs=bool(values["gpuregress_keep_runs"]),
            collectives_max_bytes=values["gpuregress_collectives_max_bytes"],
            collectives_repeats=int(values["gpuregress_collectives_repeats"]),
            nccl_protos=[p.strip() for p in str(values["gpuregress_nccl_protos"]).split(",") if p.strip()],
            nccl_algos=[a.strip() for a in str(values["gpuregress_nccl_algos"]).split(",") if a.strip()],
        )


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
