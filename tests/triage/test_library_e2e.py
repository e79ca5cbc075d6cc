"""End to end, #34 item 4: a RoPE convention changed in transformers' code and LoRA scaled by alpha / sqrt(r) in
peft's are named ``[library: transformers]`` and ``[library: peft]``, with the float64 oracle as the evidence,
never ``[kernel]``, and the advice is the library's release notes and a folder of this stack's own, never a
re-record over the reference. The faults replace the libraries' own functions, in every launch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_gpuregress.evidence.model_layout import BUILT_OTHERWISE

from ..conftest import FSDP_ONLY, FSDP_STEPS, record_references

pytestmark = [pytest.mark.slow, pytest.mark.full_tier]

LORA = "lora-accelerate and not resume"


def run(cwd: Path, refs: Path, selection: str, fault: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-steps={FSDP_STEPS}",
           f"--gpuregress-reference-dir={refs}", "-k", selection, f"--gpuregress-inject={fault}"]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def tags(out: str) -> set[str]:
    return {line.split("]", 1)[0] + "]" for line in out.splitlines() if line.startswith("[")}


def test_a_rope_change_in_transformers_is_the_library_not_a_kernel(fsdp_reference: Path, tmp_path: Path) -> None:
    done = run(tmp_path, fsdp_reference, FSDP_ONLY, "library:mode=rope_interleaved")
    assert done.returncode == 1, done.stdout[-4000:]
    assert tags(done.stdout) == {"[library: transformers]"}, done.stdout[-4000:]
    verdict = next((line for line in done.stdout.splitlines() if line.startswith("triage verdict:")), "")
    assert verdict.startswith("triage verdict: library: transformers."), done.stdout[-6000:]
    assert "model code differs: " in verdict and "oracle's step 0 on this stack differs" in verdict
    # the first op that moved reads another view of the same tensor (the odd features): called otherwise
    assert "it was called with other arguments" in verdict and "Decided by rule called-otherwise (" in verdict
    assert "code changed with transformers" in done.stdout and "transformers: check its release notes" in done.stdout
    assert "record them as the reference" not in done.stdout


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_references(tmp_path_factory.mktemp("lora-library"), f"--gpuregress-steps={FSDP_STEPS}",
                             "--gpuregress-replicas=0", "-k", LORA)


def test_a_lora_scaling_change_in_peft_is_the_library_not_a_kernel(lora_reference: Path, tmp_path: Path) -> None:
    done = run(tmp_path, lora_reference, LORA, "library:mode=lora_rslora")
    assert done.returncode == 1, done.stdout[-4000:]
    assert tags(done.stdout) == {"[library: peft]"}, done.stdout[-4000:]  # the merge check agrees with the forward
    verdict = next((line for line in done.stdout.splitlines() if line.startswith("triage verdict:")), "")
    assert verdict.startswith("triage verdict: library: peft. "), done.stdout[-6000:]
    assert "model code differs: the float64 oracle's step 0" in verdict, verdict
    # the op says whose code it was: the oracle's move and the scale peft passed agree
    assert "called with other arguments: other=2.0" in verdict and "other=2.0 in the reference, " in verdict
    assert "other=5.65685424949238 now: peft's code" in verdict and "peft's code calls it otherwise" in verdict
    assert "code changed with peft: " in done.stdout and "peft: check its release notes" in done.stdout
    assert "record them as the reference" not in done.stdout


def test_a_library_that_calls_an_op_with_another_divisor_is_named_by_the_op_not_by_a_version(
        lora_reference: Path, tmp_path: Path) -> None:
    """#46: accelerate's backward dividing the loss by the number of processes too runs the same ops on the same
    tensors; only the divisor of one aten::div differs. The step-0 trace keeps scalar arguments and whose code ran
    each op, so the verdict is accelerate's (before: [kernel], from "div moved while its inputs did not")."""
    done = run(tmp_path, lora_reference, LORA, "library:mode=accelerate_divisor")
    assert done.returncode == 1, done.stdout[-4000:]
    verdict = next((line for line in done.stdout.splitlines() if line.startswith("triage verdict:")), "")
    assert verdict.startswith("triage verdict: library: accelerate. "), done.stdout[-6000:]
    assert "Decided by rule called-otherwise (" in verdict and "(the op that introduced the difference" in verdict
    assert "called with other arguments: other=1 in" in done.stdout
    assert "other=1 in the reference, other=2 now: " in done.stdout and "accelerate's code calls it otherwise" in done.stdout
    assert "[kernel]" not in done.stdout


def test_a_tied_model_built_untied_is_the_library_judged_against_its_config_never_a_re_record(tmp_path: Path) -> None:
    # The zoo's tied model against its shipped reference: transformers' tie_weights ties nothing, so lm_head.weight
    # is a tensor of its own. The config says tie_word_embeddings: the library, not a layout to re-record over.
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpuregress", "--gpuregress-model=tiny-llama-tied",
           "-k", "fsdp-tiny-llama-tied", "--gpuregress-inject=library:mode=untied"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-4000:]
    assert tags(done.stdout) == {"[library: transformers]"}, done.stdout[-4000:]
    assert "[library: transformers] the model's config ties the input" in done.stdout
    assert "embeddings (tie_word_embeddings: true)" in done.stdout
    assert "but this stack built lm_head.weight" in done.stdout and "lm_head.weight as a tensor of its own" in done.stdout
    verdict = next(line for line in done.stdout.splitlines() if line.startswith("triage verdict:"))
    assert verdict.startswith("triage verdict: library: transformers. ") and "Decided by rule model-layout (" in verdict
    assert verdict.endswith("so the runs start from other weights")
    assert f": {BUILT_OTHERWISE} (the first finding), so the runs" in verdict
    assert f"record nothing: {BUILT_OTHERWISE} (the first finding)" in done.stdout
    assert "; report it to transformers" in done.stdout
    assert "--gpuregress-record" not in done.stdout.split("what changed in the stack")[1].split("triage verdict")[0]
