"""The collective named in a failure is the fully_shard unit that really wraps the parameter (issue #28).

GPT-2 (``transformer.h.N``) and GPT-NeoX (``gpt_neox.layers.N``) do not follow Llama's ``model.layers.N``:
their layers must still be named with their own size, not as the root group with the whole model's. A
record from before the units were kept falls back to the name pattern. Tiny models from transformers'
config classes, built in-process: nothing is downloaded, and only the last test trains.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.fsdp import SCENARIO as FSDP
from pytest_gpuregress.training.fsdp2 import RESULT_KEY, describe_units, reduce_scatter_bytes, shard_units
from pytest_gpuregress.training.models import build_causal_lm, load_config
from pytest_gpuregress.units import human_bytes

WORLD = 2
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2,
        "n_head": 2, "n_positions": 64, "n_inner": 64, "bos_token_id": 0, "eos_token_id": 0,
        "tie_word_embeddings": True, "initializer_range": 0.02, "use_cache": False}


def gpt2() -> Any:
    from transformers import GPT2Config

    return build_causal_lm(GPT2Config(**{k: v for k, v in GPT2.items() if k != "architectures"}), seed=0)


def gpt_neox() -> Any:
    from transformers import GPTNeoXConfig

    return build_causal_lm(GPTNeoXConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=64, bos_token_id=0,
                                         eos_token_id=0, use_cache=False), seed=0)


def record_of(model: Any, *, with_units: bool = True) -> RunRecord:
    """A record as fsdp/rank.py writes it at WORLD ranks, with its units or (an older one) without."""
    results = {RESULT_KEY: describe_units(model, shard_units(model), WORLD)} if with_units else {}
    return RunRecord(scenario="fsdp", config={}, platform_key="", world_size=WORLD, results=results)


def shapes_of(model: Any) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def fp32_bytes(module: Any) -> int:
    """A unit's reduce-scatter at WORLD ranks; every dim 0 below is even, so FSDP2 pads nothing."""
    assert all(p.shape[0] % WORLD == 0 for p in module.parameters())
    return 4 * sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(("build", "layers", "param", "root_param"), [
    (gpt2, "transformer.h", "transformer.h.1.attn.c_attn.weight", "transformer.wte.weight"),
    (gpt_neox, "gpt_neox.layers", "gpt_neox.layers.1.attention.query_key_value.weight", "gpt_neox.embed_in.weight"),
])
def test_a_non_llama_layer_is_named_as_its_own_group_with_its_size(build: Any, layers: str, param: str,
                                                                   root_param: str) -> None:
    model = build()
    layer = model.get_submodule(f"{layers}.1")
    assert [path for path, _ in shard_units(model)] == [f"{layers}.0", f"{layers}.1", ""]
    message = FSDP.triage.message_of(param, shapes_of(model), WORLD, record_of(model))
    assert message == f"reduce-scatter of group {layers}.1, {human_bytes(fp32_bytes(layer))}"
    # The root carries what no layer holds: its own size, not the whole model's.
    root_bytes = fp32_bytes(model) - sum(fp32_bytes(model.get_submodule(f"{layers}.{i}")) for i in range(2))
    assert FSDP.triage.message_of(root_param, shapes_of(model), WORLD, record_of(model)) == \
        f"reduce-scatter of the root group, {human_bytes(root_bytes)}"


def test_without_the_units_of_a_run_no_size_is_guessed() -> None:
    model = gpt2()
    shapes = shapes_of(model)
    unit = "reduce-scatter of the fully_shard unit that holds it (the run recorded no units)"
    assert FSDP.triage.message_of("transformer.h.1.attn.c_attn.weight", shapes, WORLD, None) == unit
    assert FSDP.triage.message_of("transformer.h.1.attn.c_attn.weight", shapes, WORLD,
                                  record_of(model, with_units=False)) == unit


def test_llama_layers_keep_their_names_and_sizes() -> None:
    model = build_causal_lm(load_config("tiny-llama", "cpu"), seed=0)
    shapes, record = shapes_of(model), record_of(model)
    assert FSDP.triage.message_of("model.layers.1.self_attn.q_proj.weight", shapes, WORLD, record) == \
        "reduce-scatter of group model.layers.1, 180.5 KiB"  # 184,832 bytes, as test_training_e2e's band says
    assert FSDP.triage.message_of("model.norm.weight", shapes, WORLD, record) == "reduce-scatter of the root group, 128.2 KiB"


def test_the_size_is_recounted_for_another_world_size() -> None:
    # Triage may hold a record of one rank while naming the N-rank message: FSDP2 pads dim 0 to N there.
    model = gpt2()
    shapes, record = shapes_of(model), record_of(model)
    params = record.results[RESULT_KEY]["transformer.h.0"]["params"]
    padded = reduce_scatter_bytes(params, shapes, 3)
    assert padded > fp32_bytes(model.get_submodule("transformer.h.0"))  # 32 rows pad to 33 at 3 ranks
    assert FSDP.triage.message_of("transformer.h.0.mlp.c_fc.bias", shapes, 3, record) == \
        f"reduce-scatter of group transformer.h.0, {human_bytes(padded)}"


def test_the_units_hold_what_fsdp2_itself_groups(one_rank_group: None) -> None:
    from torch.distributed.fsdp import fully_shard

    model = gpt2()
    units = shard_units(model)
    expected = {path: unit["params"] for path, unit in describe_units(model, units, 1).items()}
    for _path, unit in units:  # as fsdp/rank.py wraps them
        fully_shard(unit)
    names = {id(p): name for name, p in model.named_parameters()}
    grouped: dict[str, list[str]] = {}
    for path, unit in units:
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)  # FSDP2 internals: skip if they move
        if group is None or not hasattr(group, "fsdp_params"):
            pytest.skip("this torch keeps FSDP2's parameter groups elsewhere")
        grouped[path] = [names[id(fp.sharded_param)] for fp in group.fsdp_params]
    assert grouped == expected


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
@pytest.mark.slow
def test_equivalence_names_a_gpt2_layer_group_in_a_real_run(pytester: pytest.Pytester) -> None:
    (pytester.path / "tiny-gpt2.json").write_text(json.dumps(GPT2))
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "--gpuregress-model=tiny-gpt2.json",
                                "-k", "triage-equivalence-fsdp-tiny-gpt2",
                                "--gpuregress-inject=collective:op=reduce_scatter,mode=nudge,rel=1e-3,ranks=1")
    result.assert_outcomes(failed=1)
    layer = human_bytes(fp32_bytes(gpt2().get_submodule("transformer.h.1")))
    result.stdout.fnmatch_lines([f"*transformer.h.1.* carried by reduce-scatter of group transformer.h.1, {layer}*"])
    carried = [line for line in result.stdout.lines if "carried by" in line and " transformer.h." in line]
    assert carried and not any("the root group" in line for line in carried)
