"""LoRA targets for any architecture (#28): without --gpuregress-lora-targets a user's model gets every linear
projection of its decoder layers, fused ones and GPT-2's Conv1D included, never a router, the lm_head or the
embeddings; the built-in and zoo models keep the targets their shipped references store; the header says what
was targeted and what was left out. Models are built on the meta device: no weights, no training."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pytest_gpuregress.errors import NotApplicable
from pytest_gpuregress.scenarios.base import Setup
from pytest_gpuregress.scenarios.lora import DEFAULT_TARGETS, SCENARIO
from pytest_gpuregress.scenarios.lora.adapter import targeted_modules
from pytest_gpuregress.training.model_specs import ModelSpec, block_projections, parse_model
from pytest_gpuregress.training.models import config_path
from pytest_gpuregress.training.projections import NOT_ASKED, NOT_LINEAR, ROUTER, survey

REFERENCES = Path(__file__).resolve().parents[3] / "reference_runs"
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "factory_model"
TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "use_cache": False}


def save(folder: Path, config: object) -> Path:
    """A transformers config saved as ``folder/config.json``: a --gpuregress-model named after the folder."""
    config.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


def phi3(folder: Path) -> Path:
    from transformers import Phi3Config

    return save(folder / "tiny-phi3", Phi3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def gpt2(folder: Path) -> Path:
    from transformers import GPT2Config

    return save(folder / "tiny-gpt2", GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                 bos_token_id=0, eos_token_id=0, use_cache=False))


def mixtral(folder: Path) -> Path:
    from transformers import MixtralConfig

    return save(folder / "tiny-mixtral", MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2))


def deepseek_v3(folder: Path) -> Path:
    """One dense layer, then an MoE layer of 4 fused experts and a shared expert: peft moves gate_proj, up_proj
    and down_proj onto the fused experts' parameters (ParamWrapper), off the dense and shared Linears."""
    from transformers import DeepseekV3Config

    return save(folder / "tiny-deepseek", DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_group=1, topk_group=1, max_position_embeddings=64, use_cache=False))


def setup_with(folder: Path, *models: Path, targets: list[str] | None = None) -> Setup:
    options = {"gpuregress_lora_targets": targets} if targets else {}
    return Setup("cpu", "gloo", 2, models=tuple(parse_model(str(m), folder) for m in models), options=options)


def meta_model(config_dir: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir, local_files_only=True))


HEADER = re.compile(r"gpuregress lora (?P<kind>targets|left out|peft moved) \((?P<model>[\w-]+)\): (?P<said>.+)")


def header_facts(lines: list[str]) -> list[tuple[str, str, object]]:
    """Each header line as (kind, model, what it lists): targets a list of names, left out [(why, module paths)], peft
    moved (the targets moved, the fused parameters they moved onto). A line of another form fails the test."""
    out: list[tuple[str, str, object]] = []
    for line in lines:
        found = HEADER.fullmatch(line)
        assert found is not None, line
        kind, said = found["kind"], found["said"]
        if kind == "targets":
            facts: object = said.split(", ")
        elif kind == "left out":
            facts = [(why, paths.split(", ")) for why, _, paths in (part.rpartition(": ") for part in said.split("; "))]
        else:
            moved = re.fullmatch(r"(.+) onto the fused expert parameters (.+) \(target_parameters, .+\)", said)
            assert moved is not None, line
            facts = (tuple(moved[1].split(", ")), tuple(moved[2].split(", ")))
        out.append((kind, found["model"], facts))
    return out


def test_a_phi3_model_targets_its_fused_projections(tmp_path: Path) -> None:
    setup = setup_with(tmp_path, phi3(tmp_path))
    targets = SCENARIO.model_config(setup, "tiny-phi3")["target_modules"]
    # Llama's names would have matched only o_proj and down_proj, silently: the fused ones are targeted now.
    assert sorted(targets) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert SCENARIO.target_lines(setup, "tiny-phi3") == [f"gpuregress lora targets (tiny-phi3): {', '.join(targets)}"]
    SCENARIO.experiment(SCENARIO.cases(setup)[2], lambda *a: None, setup)  # applicable: no NotApplicable


def test_a_gpt2_model_targets_its_conv1d_projections_and_never_the_head_or_embeddings(tmp_path: Path) -> None:
    folder = gpt2(tmp_path)
    setup = setup_with(tmp_path, folder)
    assert sorted(SCENARIO.model_config(setup, "tiny-gpt2")["target_modules"]) == ["c_attn", "c_fc", "c_proj"]
    # The rank side finds every adapted Conv1D (the checks cover them), and nothing outside the blocks.
    found = targeted_modules(meta_model(folder), ["c_attn", "c_proj", "c_fc"])
    assert len(found) == 8 and all(name.startswith("transformer.h.") for name in found)


def test_a_mixtral_model_leaves_its_router_and_fused_experts_out_and_says_so(tmp_path: Path) -> None:
    setup = setup_with(tmp_path, mixtral(tmp_path))
    assert SCENARIO.model_config(setup, "tiny-mixtral")["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert SCENARIO.target_lines(setup, "tiny-mixtral")[1] == (
        f"gpuregress lora left out (tiny-mixtral): {NOT_LINEAR}: mlp.experts.gate_up_proj, mlp.experts.down_proj; "
        f"{ROUTER}: mlp.gate")


def test_the_header_says_what_peft_did_where_it_moves_targets_onto_fused_experts(tmp_path: Path) -> None:
    from pytest_gpuregress.training.projections import PEFT_MOVED, peft_targets

    folder = deepseek_v3(tmp_path)
    setup = setup_with(tmp_path, folder)
    targets = SCENARIO.model_config(setup, "tiny-deepseek")["target_modules"]
    assert {"gate_proj", "up_proj", "down_proj"} <= set(targets)
    done = peft_targets(meta_model(folder), targets)
    assert done.moved == ("gate_proj", "up_proj", "down_proj") and done.into == ("down_proj", "gate_up_proj")
    assert done.parameters == {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}
    assert "model.layers.0.mlp.gate_proj" not in done.modules and "model.layers.0.self_attn.q_proj" in done.modules
    lines = SCENARIO.target_lines(setup, "tiny-deepseek")
    facts = header_facts(lines)
    assert facts[1] == ("peft moved", "tiny-deepseek", (done.moved, done.into))
    assert "transformers 5's MoE layout" in lines[1]
    assert facts[2] == ("left out", "tiny-deepseek", [
        (PEFT_MOVED, ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.shared_experts.gate_proj",
                      "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"]),
        (ROUTER, ["mlp.gate"])])
    assert NOT_LINEAR not in lines[2]  # the fused experts are adapted: peft wrapped their parameters


def test_a_router_that_is_a_linear_is_not_targeted(tmp_path: Path) -> None:
    # Mixtral's router was an nn.Linear with one output per expert before transformers 5; peft's all-linear takes it.
    model = meta_model(mixtral(tmp_path))
    with torch.device("meta"):
        for layer in model.model.layers:
            layer.mlp.gate = torch.nn.Linear(32, 4, bias=False)
    found = survey(model)
    assert "gate" not in found.targets and [p.path for p in found.routers] == ["mlp.gate"]


def test_the_builtin_and_zoo_models_keep_the_targets_their_references_store(tmp_path: Path) -> None:
    # DEFAULT_TARGETS are every projection of the tiny Llama, so the default needs no model build.
    for size in ("cpu", "gpu"):
        assert block_projections(str(config_path("tiny-llama", size))).targets == DEFAULT_TARGETS
    setup = setup_with(tmp_path, Path("tiny-llama-tied"), Path("tiny-moe"))
    stored = sorted(REFERENCES.glob("lora*/*/record.json"))
    assert len(stored) == 6
    for record in stored:
        folder = record.parent.parent.name
        model = None if folder == "lora" else folder.removeprefix("lora-")
        config = json.loads(record.read_text())["config"]
        assert SCENARIO.model_config(setup, model)["target_modules"] == config["target_modules"], record


def test_the_header_names_the_targets_and_what_the_users_targets_leave_out(tmp_path: Path) -> None:
    setup = setup_with(tmp_path, phi3(tmp_path), targets=["q_proj", "v_proj", "qkv_proj"])
    assert header_facts(SCENARIO.header(setup)) == [
        ("targets", "tiny-llama", ["q_proj", "v_proj"]),
        ("left out", "tiny-llama", [(NOT_ASKED, ["self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                 "mlp.down_proj"])]),
        ("targets", "tiny-phi3", ["qkv_proj"]),
        ("left out", "tiny-phi3", [(NOT_ASKED, ["self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"])]),
    ]
    # With no option the tiny Llama's line is the defaults, the zoo MoE says what LoRA cannot reach.
    zoo = setup_with(tmp_path, Path("tiny-moe"))
    assert header_facts(SCENARIO.header(zoo)) == [
        ("targets", "tiny-llama", list(DEFAULT_TARGETS)),
        ("targets", "tiny-moe", list(DEFAULT_TARGETS)),
        ("left out", "tiny-moe", [(NOT_LINEAR, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                                  (ROUTER, ["mlp.gate", "mlp.shared_expert_gate"])]),
    ]
    absent = setup_with(tmp_path, targets=["c_attn"])
    [(kind, model, said)] = header_facts(SCENARIO.header(absent)[:1])
    assert (kind, model) == ("targets", "tiny-llama") and isinstance(said, list) and len(said) == 1
    assert said[0].startswith("none (c_attn: no module") and said[0].endswith("): lora is not applicable"), said


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Module()
        self.mix.head = torch.nn.Linear(8, 8)  # named like the model's output head
        self.norm = torch.nn.LayerNorm(8)


class Clashing(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(8, 16)


def test_a_name_shared_with_the_head_targets_the_block_path_instead() -> None:
    with torch.device("meta"):
        found = survey(Clashing())
    assert found.targets == ("mix.head",)  # "head" alone would adapt the output head too


def test_a_factory_model_targets_its_blocks_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    spec = ModelSpec("tiny_mixer", "my_models:tiny_mixer", factory=True)
    setup = Setup("cpu", "gloo", 2, models=(spec,))
    assert SCENARIO.model_config(setup, "tiny_mixer")["target_modules"] == ["mix", "up", "down"]  # not the head


NO_LINEAR = """
import torch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(8, 8))  # a projection, but no Linear module to adapt

    def forward(self, x):
        return x @ self.w

class NoLinear(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.vocab_size = 16
        self.embed = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 16)

def no_linear():
    return NoLinear()
"""


def test_a_model_without_linear_projections_is_not_applicable_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    (tmp_path / "lora_targets_no_linear.py").write_text(NO_LINEAR)
    monkeypatch.syspath_prepend(str(tmp_path))
    setup = Setup("cpu", "gloo", 2, models=(ModelSpec("no_linear", "lora_targets_no_linear:no_linear", factory=True),))
    assert SCENARIO.target_lines(setup, "no_linear") == [
        "gpuregress lora targets (no_linear): none (no Linear or Conv1D in its decoder layers): lora is not applicable",
        f"gpuregress lora left out (no_linear): {NOT_LINEAR}: w"]
    case = next(c for c in SCENARIO.cases(setup) if c.data["model"] == "no_linear")
    with pytest.raises(NotApplicable, match="has no Linear or Conv1D in its decoder layers"):
        SCENARIO.experiment(case, lambda *a: None, setup)


def test_a_session_header_names_each_models_targets(pytester: pytest.Pytester) -> None:
    phi3(pytester.path)
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "--collect-only",
                                "--gpuregress-device=cpu", "--gpuregress-model=tiny-phi3")
    result.stdout.fnmatch_lines([f"gpuregress lora targets (tiny-llama): {', '.join(DEFAULT_TARGETS)}",
                                 "gpuregress lora targets (tiny-phi3): *qkv_proj*"])
    assert "gpuregress lora left out" not in result.stdout.str()
