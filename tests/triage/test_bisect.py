"""Bisect an upgrade to the package (#47): revert what changed since the reference, in overlays, rerun step 0.

Unit tests on triage/bisect.py's plan and halving, and on the overlays' hiding; then end to end, without the
network: two versions of two tiny packages built here as wheels, one that changes a number the model computes and
one that does not. A reference is recorded with the first versions, the run upgraded to the second fails, and
--gpuregress-bisect with a wheelhouse of the first versions names the one and clears the other; the environment the
run used still has the upgraded versions afterwards."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pytest_gpuregress.triage import bisect
from pytest_gpuregress.triage.overlays import Overlays

REFERENCE = {"torch": "2.13.0", "transformers": "5.24.0", "accelerate": "1.16.0", "numpy": "2.4.6",
             "pytest-gpuregress": "0.1.0 (editable)", "tokenizers": "0.23.3"}
UPGRADED = {**REFERENCE, "torch": "2.14.1", "transformers": "5.25.0+regress1", "accelerate": "1.15.0",
            "kernels": "0.19.1"}


def test_the_plan_groups_a_package_with_what_it_now_requires_and_sets_torch_aside() -> None:
    found = bisect.plan(REFERENCE, UPGRADED, lambda p: ["kernels", "numpy"] if p == "transformers" else [])
    assert [[c.describe() for c in g] for g in found.groups] == [
        ["accelerate 1.15.0 -> 1.16.0"], ["kernels (added)", "transformers 5.25.0+regress1 -> 5.24.0"]]
    (why,) = found.grouped
    assert why.startswith("transformers with kernels (") and "the reference had none" in why
    assert [(c.package, why.split(" ")[0]) for c, why in found.untested] == [("torch", "torch")]
    # A wheelhouse holding torch's reference version lets the overlay replace torch too.
    with_torch = bisect.plan(REFERENCE, UPGRADED, lambda p: [], wheelhouse_has=lambda p, v: (p, v) == ("torch", "2.13.0"))
    assert not with_torch.untested and any(c.package == "torch" for g in with_torch.groups for c in g)
    editable = bisect.plan({"mylib": "1.0"}, {"mylib": "1.1 (editable)"}, lambda p: [])
    assert not editable.groups and "installed editable here" in editable.untested[0][1]
    local = bisect.plan({"mylib": "1.0 (local)", "other": "2.0"}, {"mylib": "1.1", "other": "2.1 (local)"}, lambda p: [])
    assert [c.package for g in local.groups for c in g] == ["other"]  # a wheel file installed now reverts fine
    assert "the reference's was installed from a folder or a file" in local.untested[0][1]


def test_halving_finds_the_group_whose_revert_restores_step_0_and_clears_the_rest() -> None:
    found = bisect.plan(REFERENCE, UPGRADED, lambda p: ["kernels"] if p == "transformers" else [])
    tried: list[list[str]] = []

    def restores(reverted: list[bisect.Change]) -> bisect.Outcome:
        tried.append(sorted(c.package for c in reverted))
        return bisect.Outcome(any(c.package == "transformers" for c in reverted), "bit for bit")

    result = bisect.bisect(found, restores)
    assert result.package == "transformers" and result.experiments == len(tried) == 3
    assert tried == [["accelerate", "kernels", "transformers"], ["accelerate"], ["kernels", "transformers"]]
    culprit = [c.describe() for c in result.culprit or []]
    assert culprit == ["kernels (added)", "transformers 5.25.0+regress1 -> 5.24.0"] and result.how == "bit for bit"
    cleared = [c.describe() for g in result.plan.groups[1:] for c in g]
    assert cleared == ["accelerate 1.15.0 -> 1.16.0"]
    untested = [(c.describe(), why.split(" ")[0]) for c, why in found.untested]
    assert untested == [("torch 2.14.1 -> 2.13.0", "torch")]
    line = result.line()
    assert line.startswith("bisect: kernels (added) and ") and " restores step 0 bit for bit; " in line
    assert "accelerate 1.15.0 -> 1.16.0 cleared" in line and "(3 experiments, " in line
    assert "not tested: torch 2.14.1 -> 2.13.0" in line
    nothing = bisect.bisect(found, lambda reverted: bisect.Outcome(False, "step0_grad lm_head.weight differs"))
    assert nothing.package is None and nothing.line().startswith("bisect: no revert restores step 0")
    assert nothing.culprit is None and "what cannot be overlaid" in nothing.line()


def test_an_added_package_is_hidden_from_imports_and_metadata_in_the_overlay(tmp_path: Path) -> None:
    """kernels arrived with transformers 5.25; reverting it means the ranks cannot see it: nothing importable from it
    (an empty namespace, which transformers' probes read as not installed), and no distribution in importlib.metadata.
    The user's environment keeps it."""
    folder = Overlays(tmp_path).hider(["pytest"])
    assert folder is not None
    probe = ("import importlib.metadata as m\n"
             "import pytest\nprint('empty:', getattr(pytest, '__file__', None), getattr(pytest, '__version__', None))\n"
             "try:\n    from pytest import fixture\nexcept ImportError:\n    print('nothing to import')\n"
             "try:\n    m.version('pytest')\nexcept m.PackageNotFoundError:\n    print('no metadata')\n"
             "print('numpy', m.version('numpy'))\n")
    env = {**os.environ, "PYTHONPATH": str(folder)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert "empty: None None" in done.stdout and "nothing to import" in done.stdout, done.stdout + done.stderr
    assert "no metadata" in done.stdout and "numpy 2." in done.stdout
    mine = subprocess.run([sys.executable, "-c", "import pytest; print(pytest.__version__)"], capture_output=True,
                          text=True, timeout=60)
    assert mine.returncode == 0


def wheel(folder: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel of ``name`` ``version`` whose package is ``source`` (built by hand: no index needed)."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": source,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def record_line(path: str, text: str) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(text.encode())}"

    files[f"{dist}/RECORD"] = "\n".join([*(record_line(p, t) for p, t in files.items()), f"{dist}/RECORD,,"]) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


TOY_MODEL = '''"""A factory model whose hidden layer is scaled by toyscale's FACTOR (toyinert is imported and changes nothing)."""
import torch
import toyinert  # noqa: F401
import toyscale


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.up(x)) * toyscale.FACTOR


class Toy(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.vocab_size = 64
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(Block(32) for _ in range(2))
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build():
    return Toy()
'''


@pytest.mark.slow
@pytest.mark.full_tier  # about 60 s: a recording, a failing comparison and three step-0 experiments on 2 ranks
def test_the_bisect_names_the_package_that_changed_a_number_and_clears_the_other(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    for version, factor in (("1.0", "1.0"), ("2.0", "1.0 + 1e-3")):
        wheel(wheels / version, "toyscale", version, f"FACTOR = {factor}\n")
        wheel(wheels / version, "toyinert", version, "WHAT = 'nothing that computes'\n")
    sites = {}
    for version in ("1.0", "2.0"):
        sites[version] = tmp_path / f"site-{version}"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--find-links",
                        str(wheels / version), "--target", str(sites[version]), f"toyscale=={version}",
                        f"toyinert=={version}"], check=True, timeout=300)
    (tmp_path / "toymodel.py").write_text(TOY_MODEL)
    refs = tmp_path / "refs"
    common = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "--gpuregress-model=toymodel:build",
              "--gpuregress-steps=4", f"--gpuregress-reference-dir={refs}", "-k", "build and fsdp and not triage"]

    def run(version: str, *extra: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sites[version]), str(tmp_path)])}
        return subprocess.run([*common, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    recorded = run("1.0", "--gpuregress-record", "--gpuregress-replicas=0")
    assert recorded.returncode == 0, recorded.stdout[-3000:]
    upgraded = run("2.0", "--gpuregress-bisect", f"--gpuregress-wheelhouse={wheels / '1.0'}")
    out = upgraded.stdout
    assert upgraded.returncode == 1, out[-4000:]
    line = next((x for x in out.splitlines() if x.startswith("bisect: ")), "")
    assert line.startswith("bisect: toyscale 2.0 -> 1.0 restores"), out[-6000:]
    assert " restores step 0 bit for bit; " in line and "; toyinert 2.0 -> 1.0 cleared (" in line
    assert "triage verdict: library: toyscale." in out and "[library: toyscale]" in out
    # The environment the run used is as it was: the upgraded versions, not the overlay's.
    kept = subprocess.run([sys.executable, "-c", "import toyscale, importlib.metadata as m; print(m.version('toyscale'))"],
                          env={**os.environ, "PYTHONPATH": str(sites["2.0"])}, capture_output=True, text=True)
    assert kept.stdout.strip() == "2.0"


def test_gpuregress_env_json_says_what_a_bisect_would_need(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pytest_gpuregress.cli import main

    assert main(["env", "--json", "--device", "cpu"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["bisect"]["packages_recorded"] == len(found["packages"]) > 10
    assert found["bisect"]["not_overlayable"]["torch"].startswith("torch itself")
    assert found["bisect"]["not_overlayable"]["pytest-gpuregress"] == "the plugin running the experiment"
