"""``gpuregress portability CHECKPOINT --config CONFIG``: does a checkpoint mean the same on this machine?

The checkpoint scenario's ``portability`` check (scenarios/checkpoint/portable.py) as a command: strict
read, the stack's own load, logits against float64 and per-tensor checksums; ``--out``/``--against``
compare two machines. Never unpickles. Exit 0 when it agrees, 1 on a difference, 2 when unusable.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GpuRegressError

FORMAT = "gpuregress-portability/1"
METADATA_KEY = "gpuregress.portability"
SHOWN_LOGITS = 6


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("portability", help="load a safetensors checkpoint on this machine: logits on a fixed "
                                                "batch, deviation from float64, per-tensor checksums; compare with "
                                                "another machine's (--out, --against)")
    parser.add_argument("checkpoint", help="a .safetensors file, or a folder with model.safetensors or its shards")
    parser.add_argument("--config", required=True, help="the checkpoint's transformers config.json, or its folder")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", help="write this machine's result to this file, for --against on another machine")
    parser.add_argument("--against", help="a file --out wrote on another machine: exit 1 when the two differ")
    parser.add_argument("--no-float64", action="store_true", help="skip the float64 evaluation (large models)")
    parser.set_defaults(func=run)


def load_config(path: Path) -> tuple[Any, Path]:
    """(the transformers config, its config.json); GpuRegressError naming the file when it is no config."""
    from transformers import AutoConfig

    folder = path.parent if path.is_file() else path
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise GpuRegressError(f"{config_file}: no such file\n  fix: pass the checkpoint's config.json (or its folder) "
                              "with --config")
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True), config_file
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise GpuRegressError(f"{config_file}: not a transformers config this installation understands ({first})"
                              "\n  fix: pass the config.json the checkpoint was saved with") from None


def _device(choice: str) -> str:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise GpuRegressError(f"--device cuda: torch {torch.__version__} sees no GPU\n  fix: use --device cpu")
    return "cuda:0" if choice != "cpu" and torch.cuda.is_available() else "cpu"


def _stack(device: str) -> dict[str, str]:
    import torch

    from ..stack.fingerprint import collect

    section = collect(device.partition(":")[0])["device"]
    name = section.get("cpu_model") if section.get("kind") == "cpu" else section.get("name")
    return {"torch": torch.__version__, "device": device, "device_name": str(name or platform.machine())}


def run(args: argparse.Namespace) -> int:
    from ..scenarios.checkpoint import files, portable
    from ..stack.determinism import set_determinism
    from ..training.models import architecture_digest

    device = _device(args.device)
    set_determinism(0, device_kind=device.partition(":")[0], cpu_threads=None)  # TF32 off
    model_config, config_file = load_config(Path(args.config))
    checkpoint = files.read(Path(args.checkpoint))  # the strict parse; evaluate loads the weights through the stack
    evaluation = portable.evaluate(checkpoint, model_config, f"the config {config_file}", device,
                                   with_float64=not args.no_float64)
    summary = {**evaluation.summary(), "format": FORMAT, "checkpoint": str(args.checkpoint),
               "architecture": architecture_digest(str(config_file.parent), ""), "stack": _stack(device)}
    _print(checkpoint, config_file, summary, evaluation)
    problems = list(evaluation.problems)
    if args.out:
        write(Path(args.out), summary, evaluation.logits)
        print(f"written: {args.out} (pass it to --against on another machine)")
    if args.against:
        problems += _against(args.against, summary, evaluation.logits)
    for problem in problems:
        print(f"  DIFFERS: {problem}")
    print("SAME" if not problems else f"DIFFERENT: {len(problems)} problem(s)")
    return 1 if problems else 0


def _against(path: str, summary: dict[str, Any], logits: np.ndarray) -> list[str]:
    """How this machine's result differs from the one another machine wrote to ``path`` (--against)."""
    from ..scenarios.checkpoint import portable

    there, logits_there = read(Path(path))
    if there["architecture"] != summary["architecture"]:
        raise GpuRegressError(f"{path}: written for another model config (architecture {there['architecture']}, this "
                              f"config's is {summary['architecture']})\n  fix: pass the config the other machine used")
    problems = portable.compare(summary, logits, there, logits_there)
    stack = there.get("stack", {})
    mine = summary["checksums"]
    equal = sum(1 for n in mine if there["checksums"].get(n, {}).get("sha256") == mine[n]["sha256"])
    print(f"against {path} ({stack.get('device_name')}, {stack.get('device')}, torch {stack.get('torch')}): "
          f"logits deviation {portable.deviation_between(logits, logits_there):.3g} (tolerance "
          f"{2 * max(summary['bound'], there['bound']):.3g}); {equal} of {len(mine)} checksums equal")
    return problems


def _print(checkpoint: Any, config_file: Path, summary: dict[str, Any], evaluation: Any) -> None:
    logits = evaluation.logits
    params = sum(int(np.prod(v.shape)) for v in checkpoint.tensors.values())
    tags = ", ".join(sorted(set(checkpoint.tags.values())))
    print(f"checkpoint: {checkpoint.path} ({len(checkpoint.tensors)} tensors, {params:,} values, {tags})")
    print(f"config:     {config_file} (architecture {summary['architecture']})")
    print(f"device:     {summary['stack']['device']} ({summary['stack']['device_name']}), torch {summary['stack']['torch']}")
    print(f"logits on the fixed batch {list(logits.shape[:2])} -> {list(logits.shape)}: sha256 "
          f"{summary['logits']['sha256'][:16]}..., sum {summary['logits']['sum']!r}")
    for row in range(logits.shape[0]):
        shown = ", ".join(f"{v:.7g}" for v in logits[row, -1, :SHOWN_LOGITS])
        print(f"  row {row}, last token: [{shown}, ...]")
    if evaluation.deviation is not None:
        print(f"deviation from float64 on this machine: {evaluation.deviation:.3g} of the largest logit "
              f"(bound u sqrt(n) (L + 1) = {evaluation.bound:.3g})")
    print("tensor checksums (sha256 of the bytes as loaded; float64 sum):")
    width = max(len(n) for n in summary["checksums"])
    for name, entry in summary["checksums"].items():
        print(f"  {name:<{width}}  {str(entry['shape']):<12} {entry['dtype']:<8} {entry['sha256'][:16]}  {entry['sum']!r}")


def write(path: Path, summary: dict[str, Any], logits: np.ndarray) -> None:
    from ..reference import atomic
    from ..scenarios.shared import safetensors_file

    tensors = [safetensors_file.stored_float32("logits", logits)]
    atomic.write_bytes(path, safetensors_file.to_bytes(tensors, {METADATA_KEY: json.dumps(summary, sort_keys=True)}))


def read(path: Path) -> tuple[dict[str, Any], np.ndarray]:
    """(summary, logits) of a file --out wrote; GpuRegressError naming the file otherwise."""
    from ..scenarios.shared import safetensors_file

    ckpt = safetensors_file.read(path)
    try:
        summary = json.loads(ckpt.metadata[METADATA_KEY])
        logits = ckpt.tensors["logits"].floats()
    except (KeyError, ValueError) as exc:
        raise GpuRegressError(f"{path}: not a file written by gpuregress portability --out ({exc!r} is missing or "
                              "unreadable)\n  fix: pass the file that --out wrote on the other machine") from None
    if summary.get("format") != FORMAT:
        raise GpuRegressError(f"{path}: format {summary.get('format')!r}, expected {FORMAT!r}\n  fix: write it again "
                              "with this version (gpuregress portability ... --out)")
    return summary, logits
