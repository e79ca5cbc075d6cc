"""A model the project has never seen (--gpuregress-model=tiny-qwen2.json): it gets test ids and references
of its own in fsdp, lora and triage, records, passes, and fails on a corrupted reduce-scatter; a config that
cannot be built, is missing or is too large stops the session naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import printed_command

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": False,
}


def write_config(folder: Path, name: str, config: dict) -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


def collect(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "--collect-only", "-q", *args)


def test_a_model_gets_its_own_cases_in_every_training_scenario(pytester: pytest.Pytester) -> None:
    write_config(pytester.path, "tiny-qwen2", QWEN2)
    pytester.makeini("[pytest]\ngpuregress_models = tiny-qwen2.json\n")
    out = collect(pytester).stdout.str()
    for test_id in ("fsdp-tiny-qwen2", "lora-fully_shard-tiny-qwen2", "lora-accelerate-tiny-qwen2",
                    "triage-equivalence-fsdp-tiny-qwen2", "triage-oracle-fsdp-tiny-qwen2",
                    "checkpoint-full-state-dict-tiny-qwen2", "checkpoint-sharded-2to1-tiny-qwen2",
                    "checkpoint-resume-tiny-qwen2", "formats-quantized-mx_fp8_e4m3fn-tiny-qwen2"):
        assert f"gpuregress::{test_id}" in out
    assert "gpuregress::fsdp" in out  # the built-in model keeps its ids and references
    selected = collect(pytester, "-k", "tiny-qwen2 and fsdp and not triage").stdout.str()
    assert "gpuregress::fsdp-tiny-qwen2" in selected and "1/2000 tests collected" in selected  # 1986 built-in + 14 of the model


@pytest.mark.parametrize(("config", "says"), [
    (None, "no such config file; pass a transformers config.json, or the folder holding it"),
    ({**QWEN2, "model_type": "no-such-architecture"}, "transformers cannot build a causal LM from it"),
    ({**QWEN2, "hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 96,
      "num_attention_heads": 512, "num_key_value_heads": 512}, "M parameters: training them takes about"),
])
def test_a_model_that_cannot_be_used_stops_the_session_naming_the_file(pytester: pytest.Pytester,
                                                                       config: dict | None, says: str) -> None:
    path = pytester.path / "mine.json" if config is None else write_config(pytester.path, "mine", config)
    result = collect(pytester, f"--gpuregress-model={path.name}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--gpuregress-model *mine.json: *{says}*"])


def test_two_models_of_one_name_or_a_reserved_name_are_refused(pytester: pytest.Pytester) -> None:
    (pytester.path / "a").mkdir()
    write_config(pytester.path, "tiny-qwen2", QWEN2)
    write_config(pytester.path / "a", "tiny-qwen2", QWEN2)
    clash = collect(pytester, "--gpuregress-model=tiny-qwen2.json", "--gpuregress-model=a/tiny-qwen2.json")
    clash.stderr.fnmatch_lines(["*has the name 'tiny-qwen2' of another model*"])
    write_config(pytester.path, "fsdp", QWEN2)
    collect(pytester, "--gpuregress-model=fsdp.json").stderr.fnmatch_lines(["*would be named 'fsdp'*"])


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
@pytest.mark.slow
def test_an_unseen_config_records_passes_and_fails_on_a_corrupted_reduce_scatter(pytester: pytest.Pytester) -> None:
    write_config(pytester.path, "tiny-qwen2", QWEN2)
    (pytester.path / "refs").mkdir()  # a comparing run's folder must exist; this one holds no reference yet
    common = ("-p", "no:cacheprovider", "--gpuregress", "--gpuregress-model=tiny-qwen2.json",
              f"--gpuregress-reference-dir={pytester.path / 'refs'}", "--gpuregress-steps=6",
              "-k", "tiny-qwen2 and fsdp and not triage")
    missing = pytester.runpytest(*common)
    missing.assert_outcomes(failed=1)  # the hint records this model: its option is part of the command
    missing.stdout.fnmatch_lines(["*fix: record one on a known-good stack: pytest --gpuregress --gpuregress-record "
                                  "gpuregress::fsdp-tiny-qwen2 * --gpuregress-model=*tiny-qwen2.json*"])
    # The printed command, run as printed, records exactly that case.
    command = printed_command(missing.stdout.str(), "record one on a known-good stack: ")
    pytester.runpytest(*command[1:], "-p", "no:cacheprovider", "--gpuregress-replicas=0").assert_outcomes(passed=1)
    stored = json.loads((pytester.path / "refs" / "fsdp-tiny-qwen2" / "cpu-gloo-w2-fp32" / "record.json").read_text())
    assert stored["config"]["model"] == "tiny-qwen2" and stored["config"]["model_file"].endswith("tiny-qwen2.json")
    passed = pytester.runpytest(*common)
    passed.assert_outcomes(passed=1)
    passed.stdout.fnmatch_lines(["fsdp-tiny-qwen2 cpu-gloo-w2-fp32: PASSED [[]exact lane[]] 6 steps*"])
    fault = "collective:op=reduce_scatter,mode=nudge,rel=1e-3"
    failed = pytester.runpytest(*common, f"--gpuregress-inject={fault}")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*[[]collective[]]*", "*triage verdict: collective*"])


DEEPSEEK_V3 = {  # one dense layer, then 4 fused experts and a shared one: peft wraps the experts' parameters
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1, "max_position_embeddings": 128,
    "tie_word_embeddings": False, "use_cache": False,
}


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
@pytest.mark.slow
def test_lora_on_fused_experts_that_peft_wraps_as_parameters_records_passes_and_fails_on_a_half_saved_adapter(
        pytester: pytest.Pytester) -> None:
    # peft 0.21 moves gate_proj, up_proj and down_proj onto DeepSeek-V3's fused experts (ParamWrapper, which has no
    # weight and takes no dropout): the merge and dropout checks run on what peft really adapted.
    write_config(pytester.path, "tiny-deepseek", DEEPSEEK_V3)
    (pytester.path / "refs").mkdir()
    common = ("-p", "no:cacheprovider", "--gpuregress", "--gpuregress-model=tiny-deepseek.json",
              f"--gpuregress-reference-dir={pytester.path / 'refs'}", "--gpuregress-steps=6",
              "-k", "lora-fully_shard-tiny-deepseek")
    recorded = pytester.runpytest(*common, "--gpuregress-record", "--gpuregress-replicas=0")
    recorded.assert_outcomes(passed=1)
    recorded.stdout.fnmatch_lines(["gpuregress lora peft moved (tiny-deepseek): gate_proj, up_proj, down_proj onto "
                                   "the fused expert parameters down_proj, gate_up_proj *"])
    pytester.runpytest(*common).assert_outcomes(passed=1)
    failed = pytester.runpytest(*common, "--gpuregress-inject=lora:mode=rank0_slice")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*[[]checkpoint[]] lora check 'sharded-save'*"])


def test_a_zoo_layout_folder_is_named_by_the_model_not_its_size(tmp_path: Path) -> None:
    from pytest_gpuregress.training.model_specs import parse_model

    (tmp_path / "my-moe" / "cpu").mkdir(parents=True)
    write_config(tmp_path / "my-moe" / "cpu", "config", QWEN2)
    assert parse_model("my-moe/cpu", tmp_path).name == "my-moe"
    assert parse_model("my-moe/cpu/config.json", tmp_path).name == "my-moe"
    (tmp_path / "plain").mkdir()
    write_config(tmp_path / "plain", "config", QWEN2)
    assert parse_model("plain", tmp_path).name == "plain"


def test_a_path_named_like_a_zoo_model_is_refused_until_written_as_a_path(tmp_path: Path) -> None:
    from pytest_gpuregress.errors import BadModel
    from pytest_gpuregress.training.model_specs import parse_model

    assert parse_model("tiny-moe", tmp_path).shipped
    (tmp_path / "tiny-moe").mkdir()
    write_config(tmp_path / "tiny-moe", "config", QWEN2)
    with pytest.raises(BadModel, match="is both a model of the zoo and a path in .*write ./tiny-moe for the path"):
        parse_model("tiny-moe", tmp_path)
    mine = parse_model("./tiny-moe", tmp_path)
    assert not mine.shipped and mine.source == str(tmp_path / "tiny-moe" / "config.json")


def test_a_missing_references_hint_selects_the_cases_that_record_it(tmp_path: Path) -> None:
    from pytest_gpuregress.plugin.options import Options
    from pytest_gpuregress.plugin.session import GpuRegressSession
    from pytest_gpuregress.training.model_specs import parse_model

    spec = parse_model(str(write_config(tmp_path, "tiny-qwen2", QWEN2)), tmp_path)
    session = GpuRegressSession(Options(enabled=True, device="cpu", models=(spec,)), tmp_path)
    try:
        assert session.selection.node_ids_for("fsdp-tiny-qwen2") == ["gpuregress::fsdp-tiny-qwen2"]  # its one case
        # lora* would re-record the model's references too: the ids themselves
        assert session.selection.node_ids_for("lora") == ["gpuregress::lora-fully_shard", "gpuregress::lora-accelerate",
                                                          "gpuregress::lora-fully_shard-resume",
                                                          "gpuregress::lora-accelerate-resume"]
        # lora-tiny-qwen2 starts none of its cases' ids: the command names the ids themselves
        assert session.selection.node_ids_for("lora-tiny-qwen2")[:2] == ["gpuregress::lora-fully_shard-tiny-qwen2",
                                                                       "gpuregress::lora-accelerate-tiny-qwen2"]
        assert "--gpuregress-model=" + spec.source in session.places.location("lora-tiny-qwen2", "cpu-gloo-w2-fp32").record_hint
    finally:
        session.close()


GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2,
        "n_head": 4, "n_positions": 128, "initializer_range": 0.02, "use_cache": False}


def test_one_lora_targets_option_serves_models_with_different_module_names(tmp_path: Path) -> None:
    from pytest_gpuregress.scenarios.base import Setup
    from pytest_gpuregress.scenarios.lora import SCENARIO as LORA
    from pytest_gpuregress.training.model_specs import parse_model

    gpt2 = parse_model(str(write_config(tmp_path, "tiny-gpt2", GPT2)), tmp_path)
    setup = Setup("cpu", "gloo", 2, models=(gpt2,), options={"gpuregress_lora_targets": ["q_proj", "v_proj", "c_attn"]})
    assert LORA.model_config(setup, None)["target_modules"] == ["q_proj", "v_proj"]  # the Llama's reference stays its own
    assert LORA.model_config(setup, "tiny-gpt2")["target_modules"] == ["c_attn"]
    from pytest_gpuregress.errors import NotApplicable

    # Without the option each model targets its own projections (tests/scenarios/lora/test_lora_targets.py); with it, a model
    # that has none of the names is not applicable, and the message says how to serve both.
    default = Setup("cpu", "gloo", 2, models=(gpt2,))
    assert LORA.model_config(default, "tiny-gpt2")["target_modules"] == ["c_attn", "c_proj", "c_fc"]
    llama_only = Setup("cpu", "gloo", 2, models=(gpt2,), options={"gpuregress_lora_targets": ["q_proj"]})
    case = next(c for c in LORA.cases(llama_only) if c.data["model"] == "tiny-gpt2")
    with pytest.raises(NotApplicable, match="has no module named q_proj.*list every model's projections in "
                                            "--gpuregress-lora-targets"):
        LORA.experiment(case, lambda *a: None, llama_only)
    # Targets match as peft matches them: a dotted suffix too. Only GPT-2 names: the Llama's lora is not applicable.
    dotted = Setup("cpu", "gloo", 2, models=(gpt2,), options={"gpuregress_lora_targets": ["mlp.down_proj", "attn.c_attn"]})
    assert LORA.model_config(dotted, None)["target_modules"] == ["mlp.down_proj"]
    assert LORA.model_config(dotted, "tiny-gpt2")["target_modules"] == ["attn.c_attn"]
    only_gpt2 = Setup("cpu", "gloo", 2, options={"gpuregress_lora_targets": ["c_attn"]})
    with pytest.raises(NotApplicable, match="the tiny Llama has no module named c_attn"):
        LORA.experiment(LORA.cases(only_gpt2)[0], lambda *a: None, only_gpt2)
