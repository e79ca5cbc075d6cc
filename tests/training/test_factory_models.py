"""A model from a factory (--gpuregress-model my_models:tiny_mixer), not a transformers config: it gets ids and
references of its own in every training scenario, records, passes, and fails on a corrupted reduce-scatter;
a factory that cannot be imported or does not say what the scenarios need stops the session naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "factory_model" / "my_models.py"


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
        assert f"gpuregress::{test_id}" in out, test_id
    assert "gpuregress::fsdp" in out and "gpuregress::checkpoint-tied" in out


# A minimal valid factory model, for the refusals below that each break one rule.
MIXER = """import torch
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        return x + self.lin(x)
class Mixer(torch.nn.Module):
    _no_split_modules = ["Block"]
    vocab_size = 16
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.block = Block()
        self.head = torch.nn.Linear(8, 16)
    def forward(self, input_ids):
        return self.head(self.block(self.embed(input_ids)))
"""


@pytest.mark.parametrize(("module", "entry", "says"), [
    (None, "no_such_module:build", "cannot import no_such_module (ModuleNotFoundError"),
    ("def other():\n    pass\n", "mine:build", "mine has no function build"),
    ("def build():\n    return 3\n", "mine:build", "returned int, not a torch.nn.Module"),
    ("import torch\ndef build():\n    return torch.nn.Linear(4, 4)\n", "mine:build", "the model says no vocabulary size"),
    ("import torch\ndef build():\n    m = torch.nn.Linear(4, 4)\n    m.vocab_size = 4\n    return m\n", "mine:build",
     "names no decoder layer class (_no_split_modules)*set _no_split_modules"),
    ("def build():\n    raise RuntimeError('no GPU for you')\n", "mine:build", "the factory raised RuntimeError: no GPU for you"),
    (MIXER + "def build():\n    m = Mixer()\n    m.register_buffer('mask', torch.ones(4, 4))\n    return m\n", "mine:build",
     "has persistent buffers (mask)*persistent=False"),
    (MIXER + "def build():\n    m = Mixer()\n    m.head.weight.requires_grad_(False)\n    return m\n", "mine:build",
     "has parameters that do not train (head.weight)"),
    (MIXER + "def build():\n    return Mixer(), torch.ones(100, dtype=torch.bfloat16)\n", "mine:build",
     "returned token ids numpy cannot read"),
    (MIXER + "def build():\n    return Mixer(), [[1, 2], [3]]\n", "mine:build", "returned token ids numpy cannot read"),
])
def test_a_factory_model_that_cannot_be_used_stops_the_session_naming_it(pytester: pytest.Pytester, module: str | None,
                                                                   entry: str, says: str) -> None:
    if module is not None:
        (pytester.path / "mine.py").write_text(module)
    result = collect(pytester, f"--gpuregress-model={entry}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--gpuregress-model {entry}: *{says}*"])


@pytest.mark.full_tier  # about 37 s; test_user_models.py records, passes and fails a user's config in the fast tier
@pytest.mark.slow
def test_a_factory_model_records_passes_and_fails_on_a_corrupted_reduce_scatter_or_checkpoint(
        pytester: pytest.Pytester, factory_dir: Path) -> None:
    # The factory that also returns its own token ids: fsdp and the checkpoint round trip train on them.
    refs = factory_dir / "refs"
    common = ["-p", "no:cacheprovider", "--gpuregress", "--gpuregress-model=my_models:tiny_mixer_with_tokens",
              f"--gpuregress-reference-dir={refs}", "--gpuregress-steps=4", "--gpuregress-replicas=0"]
    both = [*common, "-k", "tiny_mixer_with_tokens and (checkpoint-full or fsdp) and not triage"]
    pytester.runpytest(*both, "--gpuregress-record").assert_outcomes(passed=2)
    stored = json.loads((refs / "fsdp-tiny_mixer_with_tokens" / "cpu-gloo-w2-fp32" / "record.json").read_text())
    assert stored["config"]["model_factory"] == "my_models:tiny_mixer_with_tokens"
    assert stored["config"]["tokens"]["factory"] == "my_models:tiny_mixer_with_tokens"
    assert len(stored["config"]["model_architecture"]) == 12
    passed = pytester.runpytest(*both)
    passed.assert_outcomes(passed=2)
    passed.stdout.fnmatch_lines(["fsdp-tiny_mixer_with_tokens cpu-gloo-w2-fp32: PASSED [[]exact lane[]] 4 steps*"])
    # One element of each reduce-scatter off by 1e-3 (fsdp), and only rank 0's shard of each tensor saved as the
    # whole (accelerate PR #4206; the checkpoint round trip): each is caught and named.
    rs = pytester.runpytest(*common, "-k", "tiny_mixer_with_tokens and fsdp and not triage",
                            "--gpuregress-inject=collective:op=reduce_scatter,mode=nudge,rel=1e-3")
    rs.assert_outcomes(failed=1)
    rs.stdout.fnmatch_lines(["*scenario 'fsdp-tiny_mixer_with_tokens' on cpu-gloo-w2-fp32 differs from its reference*",
                             "*[[]collective[]] step0_grad *"])
    shard = pytester.runpytest(*common, "-k", "tiny_mixer_with_tokens and checkpoint-full",
                               "--gpuregress-inject=checkpoint:mode=rank0_shard")
    shard.assert_outcomes(failed=1)
    shard.stdout.fnmatch_lines(["*full-state-dict-tiny_mixer_with_tokens*"])


def test_a_factory_that_needs_real_tensors_is_sized_on_the_cpu_and_its_tokens_are_read_only_when_returned(
        pytester: pytest.Pytester) -> None:
    from pytest_gpuregress.training.factory import FactoryModel

    (pytester.path / "real.py").write_text(MIXER + "CALLS = []\n"
                                           "def with_ids():\n"
                                           "    return Mixer(), torch.randint(0, 16, (1000,)).numpy()\n"
                                           "def counted():\n"
                                           "    CALLS.append(1)\n"
                                           "    return Mixer()\n")
    pytester.syspathinsert()
    with_ids = FactoryModel("real:with_ids")
    assert with_ids.vocab_size == 16 and with_ids.num_hidden_layers == 1  # the meta call failed on .numpy(): the CPU's
    assert with_ids.tokens is not None and with_ids.tokens.dtype.name == "int64" and with_ids.tokens.size == 1000
    import real

    counted = FactoryModel("real:counted")
    assert counted.tokens is None and len(real.CALLS) == 1  # one call (on meta) told there are no token ids
    first, second = counted.empty(), counted.empty()  # seeded: the factory's own random init repeats
    assert all((a == b).all() for a, b in zip(first.state_dict().values(), second.state_dict().values()))


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
@pytest.mark.slow
def test_a_parameter_the_loss_does_not_use_counts_as_a_zero_gradient(pytester: pytest.Pytester) -> None:
    # A user's model may carry a parameter its forward never reads: no gradient, and no crash on the ranks.
    (pytester.path / "spare.py").write_text(MIXER + "def build():\n    m = Mixer()\n"
                                            "    m.spare = torch.nn.Parameter(torch.zeros(3))\n    return m\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "--gpuregress-model=spare:build",
                                f"--gpuregress-reference-dir={pytester.path / 'refs'}", "--gpuregress-steps=2",
                                "--gpuregress-replicas=0", "--gpuregress-record", "-k", "build and fsdp")
    result.assert_outcomes(passed=3)  # fsdp, and triage's equivalence and float64 oracle
    stored = json.loads((pytester.path / "refs" / "fsdp-build" / "cpu-gloo-w2-fp32" / "record.json").read_text())
    assert "spare" in stored["param_names"]
