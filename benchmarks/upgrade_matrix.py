"""The upgrade matrix: the whole main job against the shipped references, once per stack a user may have.

For each stack below it builds a venv (kept, so a second run only runs the job), installs the stack's pins and
this checkout, and runs ``pytest --gpuregress`` as a new user would, on the CPU. The GPU machine's stack runs from
the uninstalled tree, as ``benchmarks/gpu_check.sh`` runs it there. Per stack it prints how many cases passed,
how many are not supported (an op this stack's backend lacks: skipped, never failed), how many failed and the
components their reports name, the header's KNOWN ISSUE ids, and the fsdp case's worst deviation per metric as a
multiple of its tolerant-lane limit (how close the stack came to failing). docs/found-on-real-stacks.md holds the
table.

    python benchmarks/upgrade_matrix.py                        # every stack, venvs under /tmp/gpuregress-matrix
    python benchmarks/upgrade_matrix.py --only torch           # the torch releases and nothing else
    python benchmarks/upgrade_matrix.py --only 2.8 --fault     # and a run with a one-element reduce-scatter error

``--fault`` adds, per stack, the fsdp case with an injected 1e-4 reduce-scatter error, which must fail naming the
collective (or the model, where the model's code changed with the library).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name -> (pins, installs the plugin); every other package is the newest the registry serves.
STACKS: dict[str, tuple[list[str], bool]] = {
    "torch 2.8.0": (["torch==2.8.0"], True),  # the oldest pyproject.toml allows; the registry's builds are CUDA's
    "torch 2.9.1": (["torch==2.9.1"], True),
    "torch 2.10.0": (["torch==2.10.0"], True),
    "torch 2.11.0": (["torch==2.11.0"], True),
    "torch 2.12.1": (["torch==2.12.1"], True),
    "torch 2.13.0": (["torch==2.13.0"], True),  # the CPU build the shipped references were recorded with
    "torch 2.14.1": (["torch==2.14.1"], True),  # the newest the registry allows here
    # The GPU machine's own stack (torch 2.11.0+cu130), from the uninstalled tree as gpu_check.sh runs it.
    "gpu machine": (["torch==2.11.0", "transformers==5.17.0", "accelerate==1.15.0", "peft", "safetensors", "numpy",
                     "ml_dtypes", "pytest"], False),
    "transformers 4.45.2": (["torch==2.13.0", "transformers==4.45.2"], True),  # the oldest pyproject.toml allows
    "transformers 4.57.6": (["torch==2.13.0", "transformers==4.57.6"], True),  # the last 4.x
    "transformers 5.0.0": (["torch==2.13.0", "transformers==5.0.0"], True),
    "transformers 5.23.0": (["torch==2.13.0", "transformers==5.23.0"], True),  # one back from the references'
    "peft 0.20.0": (["torch==2.13.0", "peft==0.20.0"], True),
    "accelerate 1.14.0": (["torch==2.13.0", "accelerate==1.14.0"], True),
}
FAULT = "collective:op=reduce_scatter,mode=nudge,rel=1e-4"
FSDP_ONLY = "fsdp and not triage and not lora and not resume and not bf16"
VERSIONS = "import importlib.metadata as m; print(' '.join(f'{d} {m.version(d)}' for d in " \
           "('torch', 'transformers', 'peft', 'accelerate')))"


@dataclass
class JobResult:
    """One main job: its counts, the components each failed case names, and the known issues its header matched."""

    passed: int = 0
    not_supported: Counter[str] = field(default_factory=Counter)  # the op lacked -> cases
    skipped: int = 0  # skipped for another reason (too few ranks, not applicable)
    failed: Counter[str] = field(default_factory=Counter)  # component -> failed cases naming it
    failed_cases: int = 0
    known_issues: list[str] = field(default_factory=list)
    fsdp_margins: str = "-"  # the fsdp case's worst deviation per metric as a multiple of its tolerant-lane limit
    seconds: float = 0.0

    def row(self) -> str:
        lacking = ", ".join(f"{op} ({n})" for op, n in self.not_supported.items()) or "-"
        named = ", ".join(f"{c} ({n})" for c, n in self.failed.most_common()) or "-"
        return (f"{self.passed} | {sum(self.not_supported.values())}: {lacking} | {self.failed_cases}: {named} | "
                f"{', '.join(self.known_issues) or '-'} | {self.fsdp_margins} | {self.seconds:.0f}")


def sh(cmd: list[str], cwd: Path = REPO, env: dict[str, str] | None = None,
       timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def build(venv: Path, pins: list[str], install_plugin: bool) -> str:
    """Create the venv once with the stack's pins (and this checkout); returns its versions."""
    python = venv / "bin" / "python"
    if not python.exists():
        for cmd in ([sys.executable, "-m", "venv", str(venv)],
                    [str(python), "-m", "pip", "install", "-q", *pins, *(["-e", str(REPO)] if install_plugin else [])]):
            done = sh(cmd)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return sh([str(python), "-c", VERSIONS]).stdout.strip()


def main_job(venv: Path, from_tree: bool, *extra: str) -> JobResult:
    """``pytest --gpuregress`` in an empty folder, against the shipped references; read back from its JUnit XML. Its
    output is kept beside the venv (``<venv>.log``; ``<venv>-with-options.log`` for a run given ``extra``), to read what
    a failure said."""
    env = {**os.environ}
    plugin: list[str] = []
    if from_tree:  # as gpu_check.sh runs it: this tree on PYTHONPATH, no installed plugin
        env.update(PYTHONPATH=str(REPO), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        plugin = ["-p", "pytest_gpuregress.plugin"]
    with tempfile.TemporaryDirectory() as work:
        junit = Path(work) / "junit.xml"
        started = time.monotonic()
        done = sh([str(venv / "bin" / "python"), "-m", "pytest", *plugin, "-p", "no:cacheprovider", "--gpuregress",
                   f"--junitxml={junit}", *extra], cwd=Path(work), env=env)
        result = JobResult(seconds=time.monotonic() - started)
        venv.with_name(f"{venv.name}{'-with-options' if extra else ''}.log").write_text(done.stdout + done.stderr)
        result.known_issues = list(dict.fromkeys(re.findall(r"^gpuregress KNOWN ISSUE (\S+) \(", done.stdout, re.M)))
        margins = re.search(r"^fsdp cpu-\S+: \w+ .*\n(?:    .*\n)*?    worst/limit \([^)]*\): (.*)$", done.stdout, re.M)
        result.fsdp_margins = margins.group(1) if margins else "-"
        if not junit.exists():
            raise RuntimeError(f"the main job wrote no JUnit report:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        for case in ET.parse(junit).iter("testcase"):
            failure = case.find("failure")
            skipped = case.find("skipped")
            if failure is not None:
                result.failed_cases += 1
                # The components the case's findings name: the JUnit property the pipeline writes, never report text.
                named = [p.get("value", "") for p in case.iter("property") if p.get("name") == "component"]
                result.failed.update({c.strip() for v in named for c in v.split(",") if c.strip()} or {"unnamed"})
            elif skipped is not None:
                said = skipped.get("message", "")
                lacks = re.search(r"not supported: \S+ on torch \S+ lacks (\S+)", said)
                if lacks:
                    result.not_supported[lacks.group(1)] += 1
                elif "not supported" in said:
                    result.not_supported["(a training run)"] += 1
                else:
                    result.skipped += 1
            else:
                result.passed += 1
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv-root", type=Path, default=Path("/tmp/gpuregress-matrix"))
    parser.add_argument("--only", default="", help="run the stacks whose name contains this")
    parser.add_argument("--fault", action="store_true", help="also run fsdp with an injected reduce-scatter error")
    args = parser.parse_args()
    args.venv_root.mkdir(parents=True, exist_ok=True)
    rows = []
    missed: list[str] = []  # stacks where the injected fault passed, or was blamed on another component
    for name, (pins, install_plugin) in STACKS.items():
        if args.only not in name:
            continue
        venv = args.venv_root / name.replace(" ", "-")
        versions = build(venv, pins, install_plugin)
        clean = main_job(venv, not install_plugin)
        print(f"{name}: {versions}: {clean.row()}", flush=True)
        caught = ""
        if args.fault:  # must fail naming the collective (or the model, where the model's code changed)
            faulted = main_job(venv, not install_plugin, "-k", FSDP_ONLY, f"--gpuregress-inject={FAULT}")
            caught = ", ".join(faulted.failed) or "PASSES (missed)"
            if not {"collective", "model"} & set(faulted.failed):
                missed.append(name)
            print(f"  injected 1e-4 reduce-scatter error in fsdp: {caught}", flush=True)
        rows.append((name, versions, clean, caught))
    print("\n| stack | versions | passed | not supported | failed: components named | known issues | fsdp worst/limit "
          "| seconds |" + (" injected fault named |" if args.fault else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.fault else ""))
    for name, versions, clean, caught in rows:
        print(f"| {name} | {versions} | {clean.row()} |" + (f" {caught} |" if args.fault else ""))
    if missed:
        print(f"\nthe injected fault was missed or blamed on another component than the collective on: {', '.join(missed)}")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
