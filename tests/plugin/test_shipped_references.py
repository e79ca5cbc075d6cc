"""The shipped references under test: the main job passes against them, and a stack upgrade changes
only the lane, never the verdict, while real faults still fail in that lane.

These tests read reference_runs/ as it ships, so a change that makes a shipped reference stale or
foreign fails here. The upgrade is faked by rewriting the versions in a copy of the shipped
reference's fingerprint, as if it had been recorded on older libraries.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pytest_gpuregress.reference.atomic import sha256_file, write_json
from pytest_gpuregress.resources import shipped_dir

from ..conftest import FSDP_ONLY, summary_of

pytestmark = [pytest.mark.slow, pytest.mark.full_tier, pytest.mark.cpu_sensitive]

SHIPPED = shipped_dir("reference_runs")
FSDP = Path("fsdp") / "cpu-gloo-w2-fp32"
CHECKPOINT = Path("checkpoint") / "cpu-gloo-w2-fp32"
OLDER = {"torch": "2.12.0+cpu", "transformers": "5.23.0", "peft": "0.20.0", "accelerate": "1.14.0"}


def gpuregress(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "-rf", *args]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    (cwd / "gpuregress-output.txt").write_text(done.stdout + done.stderr)  # whole, where an assertion shows a tail
    return done


def recorded_on_older_libraries(folder: Path) -> None:
    """Rewrite a reference's fingerprint (and its manifest) as if it had been recorded on OLDER."""
    record = json.loads((folder / "record.json").read_text())
    record["fingerprint"]["versions"].update(OLDER)
    write_json(folder / "record.json", record)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["record.json"] = sha256_file(folder / "record.json")
    write_json(folder / "manifest.json", manifest)


@pytest.fixture(scope="module")
def upgraded_refs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the shipped fsdp reference whose fingerprint says it was recorded on older libraries."""
    refs = tmp_path_factory.mktemp("upgrade") / "refs"
    shutil.copytree(SHIPPED / "fsdp", refs / "fsdp")
    recorded_on_older_libraries(refs / FSDP)
    return refs


def test_an_upgrade_with_kernel_drift_compares_in_the_tolerant_lane_passes_and_names_each_change(
    upgraded_refs: Path, tmp_path: Path
) -> None:
    # An upgrade usually brings legitimate kernel drift too: every linear layer x (1 +- 1e-7).
    junit = tmp_path / "junit.xml"
    done = gpuregress(tmp_path, f"--gpuregress-reference-dir={upgraded_refs}", "-k", FSDP_ONLY,
                      "--gpuregress-inject=linear_noise:rel=1e-7", f"--junitxml={junit}")
    assert done.returncode == 0, done.stdout[-4000:]
    line = summary_of(done.stdout, "fsdp cpu-gloo-w2-fp32:")
    assert "PASSED [tolerant lane]" in line and "worst/limit (K x envelope + floor)" in line, line
    assert all(len(row) <= 160 for row in line.split(" | ")[:1]), line  # the head fits one terminal line
    # Every library change is on the summary line, whatever else changed on this machine (another CPU adds
    # device fields); the whole list, device fields included, is in JUnit.
    properties = {p.get("name"): p.get("value") for p in ET.parse(junit).iter("property")}
    for name, old in OLDER.items():
        assert f"{name} {old} -> " in line, (name, line)
        assert f"{name} {old} -> " in properties["stack_changes"], properties
    assert all(field in properties["stack_changes"] for field in re.findall(r"device\.\w+", line)), properties


def test_a_reduce_scatter_error_of_1e_4_still_fails_after_the_upgrade(upgraded_refs: Path, tmp_path: Path) -> None:
    fault = "collective:op=reduce_scatter,max_bytes=200000,mode=nudge,rel=1e-4"
    done = gpuregress(tmp_path, f"--gpuregress-reference-dir={upgraded_refs}", "-k", FSDP_ONLY,
                      f"--gpuregress-inject={fault}")
    assert done.returncode == 1, done.stdout[-4000:]
    out = done.stdout
    assert "lane: tolerant" in out and "[collective] step0_grad" in out
    assert "transformers 5.23.0 -> " in out  # what changed in the stack, under the findings


def test_a_small_lr_change_fails_the_tolerant_lane_at_once(tmp_path: Path) -> None:
    # With --gpuregress-fail-fast the run stops where the loss first leaves the shipped envelope.
    done = gpuregress(tmp_path, "-k", FSDP_ONLY, "--gpuregress-lane=tolerant", "--gpuregress-fail-fast",
                      "--gpuregress-inject=lr_scale:factor=1.001")
    assert done.returncode == 1, done.stdout[-4000:]
    assert "fail-fast: stopped at step " in done.stdout
    assert "[optimizer] loss: first differing step 1" in done.stdout  # triage: step 0 clean, divergence at 1


@pytest.fixture(scope="module")
def upgraded_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the shipped checkpoint bundle whose fingerprint says it was recorded on older libraries."""
    bundle = tmp_path_factory.mktemp("upgrade") / "refs" / CHECKPOINT
    shutil.copytree(SHIPPED / CHECKPOINT, bundle)
    recorded_on_older_libraries(bundle)
    return bundle


@pytest.mark.parametrize(("fault", "passes"), [
    # (No fault at all is the main job's portability case, tests/plugin/test_main_job.py.)
    ("linear_noise:rel=1e-7", True),  # legitimate kernel drift (docs/faults.md section 4)
    ("linear_noise:rel=1e-4", False),  # a kernel that is wrong
    ("checkpoint:mode=ulp_nudge", False),
])
def test_the_shipped_bundle_on_another_stack_compares_within_the_cross_platform_bound_and_checksums_stay_exact(
    upgraded_bundle: Path, tmp_path: Path, fault: str | None, passes: bool
) -> None:
    inject = [f"--gpuregress-inject={fault}"] if fault else []
    done = gpuregress(tmp_path, "-k", "portability", f"--gpuregress-portable-checkpoint={upgraded_bundle}", *inject)
    assert (done.returncode == 0) is passes, done.stdout[-4000:]
    if passes:
        assert "loaded on cpu: tolerant lane" in done.stdout
    elif fault.startswith("linear_noise"):
        assert "[checkpoint] portability: logits on the fixed batch differ by " in done.stdout
        assert "beyond the cross-platform tolerance" in done.stdout and "checksum differs" not in done.stdout
    else:  # one ulp moves no logit past the bound: only the checksum sees it
        assert "[checkpoint] portability: model.layers.1.self_attn.q_proj.weight: checksum differs" in done.stdout
        assert "logits on the fixed batch differ" not in done.stdout


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-llama-tied"])
def test_the_zoo_models_ship_a_reference_for_every_case_that_compares_one(model: str) -> None:
    """Every case of a zoo model with a reference finds it shipped, intact (sha256 manifest), and built for the
    config this code runs: the same model architecture and settings, so it is never foreign (the way a
    transformers upgrade once made the shipped reference foreign). Reads only; training is the README's job."""
    from pytest_gpuregress.reference import store
    from pytest_gpuregress.scenarios import registry
    from pytest_gpuregress.scenarios.base import Setup
    from pytest_gpuregress.training.model_specs import parse_model

    setup = Setup("cpu", "gloo", 2, models=(parse_model(model, Path.cwd()),))
    compared = set()
    for sc in registry().values():
        for case in (c for c in sc.cases(setup) if c.data.get("model") == model and sc.reference_name(c)):
            launch = next(la for la in sc.launches([case], setup) if la.key == case.launch)
            loc = store.ReferenceLocation(SHIPPED, str(sc.reference_name(case)),
                                          f"cpu-gloo-w2-{sc.platform_tag(launch.config)}")
            reference = store.read_reference(loc)  # checks the manifest
            folder = loc.path
            # Every key the reference holds, as this code sets it (the launch config may add session-only keys).
            assert "model_architecture" in reference.config, folder
            now = {k: launch.config.get(k, "<absent>") for k in reference.config}
            assert store.config_differences(reference.config, now) == [], folder
            compared.add(folder.parent.name)
    assert compared == {f"fsdp-{model}", f"lora-{model}", f"checkpoint-{model}", f"formats-{model}"}
