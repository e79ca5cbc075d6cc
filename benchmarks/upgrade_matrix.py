"""A real upgrade matrix: build a venv per stack, run the main comparison against the shipped references.

For each stack below it installs this checkout with one library moved to another version, then
runs ``pytest --gpuregress -k fsdp`` against the shipped CPU reference twice: clean, and with an
injected one-element reduce-scatter error of 1e-4. It prints one row per stack: the lane, the
worst deviation per metric as a multiple of its tolerance, and the verdict of both runs. Every
clean row must pass and every injected row must fail.

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
    "transformers 5.23.0": ["transformers==5.23.0"],
    "torch 2.14.1": ["torch==2.14.1"],  # the newest the registry allows here; its CUDA build runs on the CPU
    "peft 0.20.0": ["peft==0.20.0"],  # one minor version back from 0.21
    "accelerate 1.14.0": ["accelerate==1.14.0"],  # one minor version back from 1.15
}
FAULT = "collective:op=reduce_scatter,mode=nudge,rel=1e-4"
FSDP_ONLY = "fsdp and not triage and not lora"  # the fsdp comparison alone (triage and lora have their own tests)
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


def compare(venv: Path, workdir: Path, *extra: str) -> tuple[bool, str]:
    """(passed, the fsdp summary line) of one comparison against the shipped reference."""
    done = sh([str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "-k", FSDP_ONLY,
               *extra], cwd=workdir)
    line = next((x for x in done.stdout.splitlines() if x.startswith("fsdp ")), done.stdout[-500:] + done.stderr[-500:])
    return done.returncode == 0, line


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
        clean_ok, clean = compare(venv, args.venv_root)
        fault_ok, _ = compare(venv, args.venv_root, f"--gpuregress-inject={FAULT}")
        lane = re.search(r"\[(\w+) lane\]", clean)
        rows.append((name, lane.group(1) if lane else "?", margins(clean), clean_ok, fault_ok))
        print(f"{name}: {versions}; {time.monotonic() - started:.0f}s\n  clean: {clean}", flush=True)
    print("\n| stack | lane | " + " | ".join(METRICS) + " | clean | injected 1e-4 reduce-scatter |")
    print("|" + "---|" * (len(METRICS) + 4))
    for name, lane, cells, clean_ok, fault_ok in rows:
        print(f"| {name} | {lane} | " + " | ".join(cells[m] for m in METRICS)
              + f" | {'pass' if clean_ok else 'FAIL'} | {'fails (caught)' if not fault_ok else 'PASSES (missed)'} |")
    bad = [r[0] for r in rows if not r[3] or r[4]]
    print(f"\n{len(rows)} stacks; " + ("every clean row passes and every injected row fails" if not bad
                                      else f"WRONG verdicts on: {', '.join(bad)}"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
