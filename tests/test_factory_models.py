"""A model from a factory (--gpuregress-model my_models:tiny_mixer), not a transformers config: it gets ids and
references of its own in every training scenario, records, passes, and fails on a corrupted reduce-scatter;
a factory that cannot be imported or does not say what the scenarios need stops the session naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import records_passes_and_breaks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "factory_model" / "my_models.py"


@pytest.fixture
def factory_dir(pytester: pytest.Pytester) -> Path:
    shutil.copy(EXAMPLE, pytester.path / "my_models.py")
    return pytester.path


def collect(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "--collect-only", "-q", *args)


def test_a_factory_model_gets_its_own_cases_in_every_training_scenario(pytester: pytest.Pytester,
                                                                     factory_dir: Path) -> None:
    out = collect(pytester, "--gpuregress-model=my_models:tiny_mixer").stdout.str()
    for test_id in ("fsdp-tiny_mixer", "lora-fully_shard-tiny_mixer", "lora-accelerate-tiny_mixer",
                    "triage-equivalence-fsdp-tiny_mixer", "triage-oracle-fsdp-tiny_mixer",
                    "checkpoint-full-state-dict-tiny_mixer", "checkpoint-sharded-2to1-tiny_mixer",
                    "checkpoint-sharded-1to2-tiny_mixer", "checkpoint-resume-tiny_mixer",
                    "formats-quantized-per_tensor_e4m3fn-tiny_mixer", "formats-quantized-mx_fp4_e2m1fn-tiny_mixer"):
        assert f"test_scenario[{test_id}]" in out, test_id
    assert "test_scenario[fsdp]" in out and "test_scenario[checkpoint-tied]" in out


@pytest.mark.parametrize(("module", "entry", "says"), [
    (None, "no_such_module:build", "cannot import no_such_module (ModuleNotFoundError"),
    ("def other():\n    pass\n", "mine:build", "mine has no function build"),
    ("def build():\n    return 3\n", "mine:build", "returned int, not a torch.nn.Module"),
    ("import torch\ndef build():\n    return torch.nn.Linear(4, 4)\n", "mine:build", "the model says no vocabulary size"),
    ("import torch\ndef build():\n    m = torch.nn.Linear(4, 4)\n    m.vocab_size = 4\n    return m\n", "mine:build",
     "names no decoder layer class (_no_split_modules)*set _no_split_modules"),
    ("def build():\n    raise RuntimeError('no GPU for you')\n", "mine:build", "the factory raised RuntimeError: no GPU for you"),
])
def test_a_factory_that_cannot_be_used_stops_the_session_naming_it(pytester: pytest.Pytester, module: str | None,
                                                                   entry: str, says: str) -> None:
    if module is not None:
        (pytester.path / "mine.py").write_text(module)
    result = collect(pytester, f"--gpuregress-model={entry}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--gpuregress-model {entry}: *{says}*"])


@pytest.mark.slow
def test_a_factory_model_records_passes_and_fails_on_a_corrupted_reduce_scatter(pytester: pytest.Pytester,
                                                                                factory_dir: Path) -> None:
    refs = factory_dir / "refs"
    args = ["-p", "no:cacheprovider", "--gpuregress", "--gpuregress-model=my_models:tiny_mixer",
            f"--gpuregress-reference-dir={refs}", "--gpuregress-steps=6", "--gpuregress-replicas=0",
            "-k", "tiny_mixer and fsdp and not triage"]
    records_passes_and_breaks(pytester.runpytest, args, refs, "fsdp-tiny_mixer",
                              "collective:op=reduce_scatter,mode=nudge,rel=1e-3",
                              ["*[[]collective[]] step0_grad *"], steps=6)
    stored = json.loads((refs / "fsdp-tiny_mixer" / "cpu-gloo-w2-fp32" / "record.json").read_text())
    assert stored["config"]["model_factory"] == "my_models:tiny_mixer"
    assert len(stored["config"]["model_architecture"]) == 12


@pytest.mark.slow
def test_a_factory_model_round_trips_its_checkpoint_and_trains_on_its_own_tokens(pytester: pytest.Pytester,
                                                                                  factory_dir: Path) -> None:
    refs = factory_dir / "refs"
    common = ["-p", "no:cacheprovider", "--gpuregress", "--gpuregress-model=my_models:tiny_mixer_with_tokens",
              f"--gpuregress-reference-dir={refs}", "--gpuregress-steps=4", "--gpuregress-replicas=0"]
    both = [*common, "-k", "tiny_mixer_with_tokens and (checkpoint-full or fsdp) and not triage"]
    pytester.runpytest(*both, "--gpuregress-record").assert_outcomes(passed=2)
    stored = json.loads((refs / "fsdp-tiny_mixer_with_tokens" / "cpu-gloo-w2-fp32" / "record.json").read_text())
    assert stored["config"]["tokens"]["factory"] == "my_models:tiny_mixer_with_tokens"
    pytester.runpytest(*both).assert_outcomes(passed=2)
    # Only rank 0's shard of each tensor saved as the whole (accelerate PR #4206): the round trip names it.
    broken = pytester.runpytest(*common, "-k", "tiny_mixer_with_tokens and checkpoint-full",
                                "--gpuregress-inject=checkpoint:mode=rank0_shard")
    broken.assert_outcomes(failed=1)
    broken.stdout.fnmatch_lines(["*full-state-dict-tiny_mixer_with_tokens*"])
