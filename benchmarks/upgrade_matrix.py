"""A real upgrade matrix: build a venv per stack, run the main comparison against the shipped references.

For each stack below it installs this checkout with one library moved to another version, then
runs ``pytest --gpuregress -k fsdp`` for the built-in model and the zoo models (tiny-moe,
tiny-llama-tied) against the shipped CPU references twice: clean, and with an injected
one-element reduce-scatter error of 1e-4. It prints one row per stack and model: the lane, the
worst deviation per metric as a multiple of its tolerance, and the verdict of both runs. Every
clean row must pass, or get the ``model`` verdict (the model's own code changed with the library,
so the reference cannot judge it, and the message says how to record one); every injected row
must fail, naming the collective (or, where the model changed, the model).

    python benchmarks/upgrade_matrix.py                     # all stacks, venvs under /tmp/gpuregress-matrix
    python benchmarks/upgrade_matrix.py --only transformers # one stack

The venvs are kept, so a second run only runs the comparisons.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_TORCH = "torch==2.13.0"  # the CPU build the shipped reference was recorded with
STACKS: dict[str, list[str]] = {
    "transformers 4.45.2": ["transformers==4.45.2"],  # the oldest pyproject.toml allows
    "transformers 4.57.6": ["transformers==4.57.6"],  # the last 4.x: experts as modules of their own
    "transformers 5.0.0": ["transformers==5.0.0"],
    "transformers 5.23.0": ["transformers==5.23.0"],
    "transformers 5.25.0": ["transformers==5.25.0"],  # the first that requires kernels, which wraps its RoPE
    "torch 2.8.0": ["torch==2.8.0"],  # the oldest pyproject.toml allows; the registry's build is CUDA's, run on the CPU
    "torch 2.9.1": ["torch==2.9.1"],
    "torch 2.10.0": ["torch==2.10.0"],  # the first with torch.utils._debug_mode, with fewer switches than 2.11's
    "torch 2.11.0": ["torch==2.11.0"],
    "torch 2.12.1": ["torch==2.12.1"],
    "torch 2.14.1": ["torch==2.14.1"],  # the newest the registry allows here
    # The GPU machine's own stack (benchmarks/gpu_check.sh runs the plugin there from the tree), on the CPU.
    "gpu machine": ["torch==2.11.0", "transformers==5.17.0", "accelerate==1.15.0"],
    "peft 0.20.0": ["peft==0.20.0"],  # one minor version back from 0.21
    "accelerate 1.14.0": ["accelerate==1.14.0"],  # one minor version back from 1.15
}
FAULT = "collective:op=reduce_scatter,mode=nudge,rel=1e-4"
FSDP_ONLY = "fsdp and not triage and not lora and not resume"  # the fsdp comparison alone (the others have their own tests)
ZOO = ("tiny-moe", "tiny-llama-tied")
MODELS = ("fsdp", *(f"fsdp-{m}" for m in ZOO))  # the summary line each model's comparison starts with
METRICS = ("loss", "grad_norm", "param_grad_norm", "step0_grad", "final_weights")


def sh(cmd: list[str], cwd: Path = REPO, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def build(venv: Path, pins: list[str]) -> str:
    """Create the venv once: the base torch, this checkout, then the stack's pins. Returns the versions."""
    python = venv / "bin" / "python"
    if not python.exists():
        for cmd in ([sys.executable, "-m", "venv", str(venv)],
                    [str(python), "-m", "pip", "install", "-q", BASE_TORCH],
                    [str(python), "-m", "pip", "install", "-q", "-e", str(REPO)],
                    [str(python), "-m", "pip", "install", "-q", *pins]):
            done = sh(cmd)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    versions = sh([str(python), "-c", "import importlib.metadata as m; print(' '.join(f'{d} {m.version(d)}' "
                                     "for d in ('torch', 'transformers', 'peft', 'accelerate')))"])
    return versions.stdout.strip()


def compare(venv: Path, workdir: Path, *extra: str) -> dict[str, tuple[str, str]]:
    """Per model (its summary line's first word): (verdict, summary line) of one comparison against the shipped
    references. Verdicts: pass, model (the model's code changed: no judgement), or the components it blamed."""
    zoo = [f"--gpuregress-model={m}" for m in ZOO]
    done = sh([str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", *zoo,
               "-k", FSDP_ONLY, *extra], cwd=workdir)
    out: dict[str, tuple[str, str]] = {}
    for model in MODELS:
        line = next((x for x in done.stdout.splitlines() if x.startswith(model + " ")), "")
        section = done.stdout.split(f"gpuregress::{model}")[1] if f"gpuregress::{model}" in done.stdout else ""
        section = section.split("gpuregress::")[0]
        if ": PASSED" in line:
            verdict = "pass"
        elif "[model]" in section:
            verdict = "model"
        elif line:
            verdict = "/".join(sorted(set(re.findall(r"^\[([a-z ]+)\]", section, re.M)))) or "failed"
        else:
            verdict, line = "error", done.stdout[-300:] + done.stderr[-300:]
        out[model] = (verdict, line)
    return out


def margins(line: str) -> dict[str, str]:
    found = re.search(r"worst/limit \([^)]*\): ([^;]*)", line)
    cells = dict(re.findall(r"(\w+) ([\d.e+-]+x)", found.group(1))) if found else {}
    return {m: cells.get(m, "-") for m in METRICS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv-root", type=Path, default=Path("/tmp/gpuregress-matrix"))
    parser.add_argument("--only", default="", help="run the stacks whose name contains this")
    args = parser.parse_args()
    args.venv_root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, pins in STACKS.items():
        if args.only not in name:
            continue
        started = time.monotonic()
        venv = args.venv_root / name.replace(" ", "-")
        versions = build(venv, pins)
        clean = compare(venv, args.venv_root)
        faulted = compare(venv, args.venv_root, f"--gpuregress-inject={FAULT}")
        print(f"{name}: {versions}; {time.monotonic() - started:.0f}s", flush=True)
        for model in MODELS:
            verdict, line = clean[model]
            lane = re.search(r"\[(\w+) lane\]", line)
            rows.append((name, model, lane.group(1) if lane else "?", margins(line), verdict, faulted[model][0]))
            print(f"  {model} clean: {line}", flush=True)
    print("\n| stack | model | lane | " + " | ".join(METRICS) + " | clean | injected 1e-4 reduce-scatter |")
    print("|" + "---|" * (len(METRICS) + 5))
    for name, model, lane, cells, clean_verdict, fault_verdict in rows:
        print(f"| {name} | {model} | {lane} | " + " | ".join(cells[m] for m in METRICS)
              + f" | {clean_verdict} | {'caught: ' + fault_verdict if fault_verdict != 'pass' else 'PASSES (missed)'} |")
    bad = [f"{r[0]} {r[1]}" for r in rows
           if r[4] not in ("pass", "model") or r[5] not in (("collective",) if r[4] == "pass" else ("model",))]
    print(f"\n{len(rows)} rows; " + ("every clean row passes or gets the model verdict, and every injected row is "
                                     "caught with the right component" if not bad else f"WRONG verdicts on: {', '.join(bad)}"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
