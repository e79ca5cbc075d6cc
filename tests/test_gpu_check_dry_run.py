"""benchmarks/gpu_check.sh in its CPU dry run: the steps the one GPU run will take, with the same paths and
options, run here first, so a wrong path or option fails in CI rather than on the device.

The GPU machine has no package index: it runs the plugin from a plain copy of the tree, never installed, on its
own Python. So does the dry run here: from a copy of the tracked files, with a Python whose packages are the
plugin's dependencies only (this venv's site-packages less the plugin's own install and its entry points)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
STEPS = ("env", "platform-key", "record", "reference-at-key", "compare", "sdpa-backend", "sdpa-forced",
         "host-op", "inventory", "protocols", "collective-fault", "sweep-bench")
# What `pip install -e .` of this plugin leaves in site-packages: the path to the tree, and its metadata with the
# entry points. Without them, nothing of the plugin is installed.
_OWN_INSTALL = ("_editable_impl_pytest_gpuregress", "__editable__", "pytest_gpuregress", "_pytest_gpuregress")


def uninstalled_copy(target: Path) -> Path:
    """The tracked and untracked-not-ignored files of this checkout (what `git archive` ships, plus uncommitted
    work), copied to ``target``: no .git, no venv, no egg-info."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # as git stores it (pytest_gpuregress/_data links to the shipped folders)
            (target / name).symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target / name)
    return target


def dependencies_only_python(folder: Path) -> Path:
    """A venv whose importable packages are this one's but for the plugin itself: a link to each entry of this
    venv's site-packages that is not the plugin's own install, made reachable by a .pth file."""
    site = Path(sysconfig.get_paths()["purelib"])
    links = folder / "deps"
    links.mkdir(parents=True)
    for entry in site.iterdir():
        if not entry.name.startswith(_OWN_INSTALL):
            (links / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder / "venv")], check=True)
    python = folder / "venv" / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    (Path(venv_site) / "deps.pth").write_text(f"{links}\n")
    return python


@pytest.mark.slow
@pytest.mark.full_tier  # about 100 s on 2 cores: the full tier, which CI runs
def test_the_dry_run_from_an_uninstalled_copy_meets_every_expectation_and_tables_each_step(tmp_path: Path) -> None:
    tree = uninstalled_copy(tmp_path / "tree")
    python = dependencies_only_python(tmp_path / "python")
    plugin_installed = subprocess.run([str(python), "-c", "import importlib.metadata as m; m.version('pytest-gpuregress')"],
                                      capture_output=True, cwd=tmp_path)
    assert plugin_installed.returncode != 0  # the copy is all there is of the plugin
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(python)}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(["bash", str(tree / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env,
                            capture_output=True, text=True, timeout=900, cwd=tmp_path)
    table = (out / "table.txt").read_text()
    assert result.returncode == 0, table + result.stdout[-6000:] + result.stderr[-2000:]
    header, *rows, footer = table.splitlines()
    assert header.split() == ["step", "expected", "outcome", "seconds", "verdict"]
    assert [row.split()[0] for row in rows] == list(STEPS)
    assert all(row.split()[-1] == "ok" for row in rows), table
    assert "dry run (CPU)" in footer and "platform key cpu-gloo-w2-fp32" in footer
    assert "every step as expected" in footer
    # The CPU's own expectations: 2 gloo ranks catch the collective fault, and gloo has no NCCL protocols.
    by_step = {row.split()[0]: row for row in rows}
    assert "fail /wrong elements/" in by_step["collective-fault"]
    assert "pass /does not apply to gloo/" in by_step["protocols"]
    # The GPU run's estimated time, for one GPU and for eight, from the steps it launches; one GPU fits 360 s.
    budget = (out / "budget.txt").read_text()
    assert "GPU budget estimate (" in budget and "(one GPU, 50 steps, 1 replicas): " in budget
    assert "(2+ GPUs, " in budget
    assert "of the 360 s budget\n" in budget


def test_a_step_that_differs_from_its_expectation_fails_the_check(tmp_path: Path) -> None:
    # A budget spent before the first step: every step is "not run", which no expectation allows. No rank starts.
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "GPU_CHECK_BUDGET": "1"}
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    table = (tmp_path / "table.txt").read_text()
    assert result.returncode == 1, table
    rows = table.splitlines()[1:-1]
    assert [row.split()[0] for row in rows] == list(STEPS) and all(row.split()[-1] == "DIFFERS" for row in rows)
    assert "SOME STEPS DIFFER FROM THEIR EXPECTATION" in table
