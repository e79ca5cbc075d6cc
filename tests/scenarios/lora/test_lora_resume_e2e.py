"""Resume across stacks for lora (lora-fully_shard-resume, lora-accelerate-resume): each wrapper's reference keeps
its own checkpoint at step S, and a comparison loads it on this machine's stack, in that wrapper's lane, and trains
on. Real gloo ranks, peft under FSDP2 and under accelerate (DDP on the CPU), DCP in safetensors.

The module records both lora references once (8 steps, no replicas: the checkpoints at step 6). Clean, each
continuation repeats its reference's last 2 steps bit for bit; a load that leaves a piece unrestored is named
piece by piece, as a [checkpoint] failure; a reference without a checkpoint skips the case with the reason. One
cheap test of the session side (no ranks) stays in the fast tier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pytest_gpuregress.errors import NotApplicable
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios import registry
from pytest_gpuregress.scenarios.base import Launch, Setup
from pytest_gpuregress.scenarios.shared import resume_comparison

from ...conftest import make_record, record_references, reproduced

STEPS = "8"
PLATFORM = "cpu-gloo-w2-fp32"
RESUMES = "lora and resume"
SAVED = "after loading the reference's checkpoint is not the state it saved at step 6"
FIRST = "base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight"  # the first adapter tensor by name


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The wrapper cases alone: recording a wrapper's reference saves its resume checkpoint whichever case asks.
    refs = record_references(tmp_path_factory.mktemp("lora-resume"), f"--gpuregress-steps={STEPS}",
                             "--gpuregress-replicas=0", "-k", "lora and not resume")
    for wrapper in ("fsdp2", "accelerate"):
        assert (refs / "lora" / f"{PLATFORM}-{wrapper}" / "resume" / "trainer.json").is_file(), wrapper
    return refs


def run(pytester: pytest.Pytester, refs: Path, selection: str, *extra: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={STEPS}",
                              f"--gpuregress-reference-dir={refs}", "-k", selection, "-rs", *extra)


def test_the_resume_cases_share_their_wrappers_reference_and_are_skipped_where_they_cannot_run() -> None:
    """Session side, no ranks: each case judges its wrapper's reference (same launch, same folder), is never
    triaged, runs no LoRA check of its own, and is skipped with the reason where there is no checkpoint to load."""
    lora = registry()["lora"]
    cpu = Setup("cpu", "gloo", 2)
    cases = {c.id: c for c in lora.cases(cpu)}

    def never(sc: object, launch: Launch) -> RunRecord:
        raise AssertionError("no launch for a case that cannot run")

    without = make_record(steps=8)
    for wrapper, case_id in (("fsdp2", "fully_shard"), ("accelerate", "accelerate")):
        resume, main = cases[f"{case_id}-resume"], cases[case_id]
        assert resume.launch == main.launch == wrapper
        assert lora.reference_name(resume) == lora.reference_name(main) == "lora"
        assert not lora.triage_explains(resume)
        assert lora.own_findings(resume, make_record(results={resume_comparison.LOADED_KEY: {"step": 4}}), cpu) == []
        with pytest.raises(NotApplicable, match=r"the reference has no resume checkpoint: re-record it: pytest "
                                                r"--gpuregress --gpuregress-record 'gpuregress::lora\*'$"):
            lora.from_reference(resume, lambda: without, never, cpu)
        with pytest.raises(NotApplicable, match=r"on GPUs the resume checkpoint is optional .* about 0\.64 GB for the "
                                                r"156 M-parameter model\): record and compare it with "
                                                r"--gpuregress-resume-checkpoint"):
            lora.from_reference(resume, lambda: without, never, Setup("cuda", "nccl", 8))
        assert lora.from_reference(main, lambda: without, never, cpu) is None  # the wrapper's case runs as it always has


@pytest.mark.slow
@pytest.mark.full_tier  # the fast tier is over its budget: the ranks run in the full tier
def test_each_wrappers_checkpoint_resumes_on_this_stack_bit_for_bit(pytester: pytest.Pytester, recorded: Path) -> None:
    for wrapper in ("fsdp2", "accelerate"):
        resume = recorded / "lora" / f"{PLATFORM}-{wrapper}" / "resume"
        assert sorted(p.name for p in resume.iterdir()) == ["rng-rank0.json", "rng-rank1.json", "tensors",
                                                            "trainer.json"]
        assert not [p for p in resume.rglob("*") if p.is_file() and not p.name.endswith((".json", ".safetensors"))]
    result = run(pytester, recorded, RESUMES)
    result.assert_outcomes(passed=2)
    for wrapper, case in (("fsdp2", "fully_shard"), ("accelerate", "accelerate")):
        result.stdout.fnmatch_lines([f"lora-{case}-resume {PLATFORM}-{wrapper}: PASSED [[]exact lane[]] 2 steps, *",
                                     f"*note: lora-{case}-resume: the reference's checkpoint (step 6, written with "
                                     "torch *) loaded on this stack, trained on to step 8*"])
    assert "lora check '" not in result.stdout.str()  # a continuation runs no LoRA check


@pytest.mark.slow
@pytest.mark.full_tier  # the fast tier is over its budget: the ranks run in the full tier
def test_generators_left_unrestored_and_weights_applied_late_are_named_in_both_lanes(
        pytester: pytest.Pytester, recorded: Path) -> None:
    result = run(pytester, recorded, RESUMES, "--gpuregress-inject=checkpoint:mode=rng_not_restored",
                 "--gpuregress-inject=checkpoint:mode=weights_late")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    for wrapper in ("fsdp2", "accelerate"):
        result.stdout.fnmatch_lines([
            f"*scenario 'lora' on {PLATFORM}-{wrapper} differs from its reference*",
            f"[[]checkpoint[]] resume: model {SAVED} (28 of 28 tensors differ, first {FIRST})",
            # The frozen base too: the resume zeroes it before the load, so weights not yet applied show.
            f"[[]checkpoint[]] resume: model.frozen {SAVED} (* of * tensors differ, first base_model.model.*)",
            f"[[]checkpoint[]] resume: rng.python {SAVED} (2 of 2 ranks differ, first rank0)",
            f"[[]checkpoint[]] resume: rng.numpy {SAVED} (2 of 2 ranks differ, first rank0)",
            f"[[]checkpoint[]] resume: rng.torch_cpu {SAVED} (2 of 2 ranks differ, first rank0)",
            # The weights step 6 ran on were the fresh adapter's: the curve moves at once, put down to the load.
            "[[]checkpoint[]] resumed at step 6 (steps counted from there): loss: first differing step 0 of 2:*"])
    assert "resume: optimizer." not in out  # what the load did restore is not named
    assert "triage" not in out  # triage reruns step 0, which a continuation never ran


@pytest.mark.slow
@pytest.mark.full_tier  # the fast tier is over its budget: the ranks run in the full tier
def test_adamw_state_under_accelerates_wrapper_dropped_on_load_is_named(pytester: pytest.Pytester, recorded: Path) -> None:
    result = run(pytester, recorded, "accelerate-resume", "--gpuregress-inject=checkpoint:mode=optimizer_dropped")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        f"[[]checkpoint[]] resume: optimizer.exp_avg {SAVED} (28 of 28 tensors differ, first {FIRST})",
        f"[[]checkpoint[]] resume: optimizer.exp_avg_sq {SAVED} (28 of 28 tensors differ, first {FIRST})",
        f"[[]checkpoint[]] resume: optimizer.step {SAVED} (28 of 28 tensors differ, first {FIRST}: 6.0 -> 1.0)",
        f"[[]checkpoint[]] resume: optimizer.param_groups {SAVED} (1 of 1 entries differ, first group0)",
        "[[]checkpoint[]] resumed at step 6 (steps counted from there): loss: first differing step 1 of 2:*"])
    out = result.stdout.str()
    assert f"resume: model {SAVED}" not in out and "resume: model.frozen" not in out and "rng." not in out
    assert reproduced(out) == [1]  # the printed command judges the kept run the same way


@pytest.mark.slow
@pytest.mark.full_tier  # the fast tier is over its budget: the ranks run in the full tier
def test_a_reference_without_a_checkpoint_skips_the_case_with_the_reason(pytester: pytest.Pytester, recorded: Path) -> None:
    refs = pytester.path / "refs"
    shutil.copytree(recorded, refs)
    folder = refs / "lora" / f"{PLATFORM}-fsdp2"
    shutil.rmtree(folder / "resume")  # as a reference recorded before resume checkpoints existed
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("resume/")}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    result = run(pytester, refs, "fully_shard-resume")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*not applicable: the reference has no resume checkpoint: re-record it: pytest "
                                 "--gpuregress --gpuregress-record 'gpuregress::lora[*]'*"])
