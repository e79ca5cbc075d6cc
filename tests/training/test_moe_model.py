"""tiny-moe: the configs build, the seeded init covers the router and the fused experts, routing spreads the load.

Single process, a few seconds: one CPU-size build shared by the module, a meta-device build of the GPU size.
"""

from __future__ import annotations

import numpy as np
import pytest

from pytest_gpuregress.training.data import MarkovTokens
from pytest_gpuregress.training.models import load_config, seeded_normal
from pytest_gpuregress.training.moe import expert_load, is_moe, num_experts, router_modules

torch = pytest.importorskip("torch")

SEED = 0


@pytest.fixture(scope="module")
def cpu_config():
    return load_config("tiny-moe", "cpu")


@pytest.fixture(scope="module")
def model(cpu_config):
    from pytest_gpuregress.training.models import build_causal_lm

    return build_causal_lm(cpu_config, seed=SEED)


@pytest.fixture(scope="module")
def tokens(cpu_config):
    """One rank's inputs at the CPU scenario's size: 8 of the 16 sequences, 64 tokens each."""
    data = MarkovTokens(vocab_size=cpu_config.vocab_size, seq_len=64, global_batch=16, seed=1234)
    return torch.from_numpy(data.rank_batch(0, 0, 2)[:, :-1])


@pytest.mark.parametrize("size", ["cpu", "gpu"])
def test_configs_describe_a_routed_moe_trained_on_plain_cross_entropy(size: str) -> None:
    cfg = load_config("tiny-moe", size)
    assert is_moe(cfg) and cfg.num_experts_per_tok < num_experts(cfg)
    assert cfg.model_type == "qwen2_moe"
    assert cfg.decoder_sparse_step == 1 and not cfg.mlp_only_layers  # every layer routes
    # No router aux loss anywhere near the loss: scenarios take .logits, and even .loss would not add it.
    assert cfg.output_router_logits is False and cfg.router_aux_loss_coef == 0.0
    assert cfg.use_cache is False and cfg.tie_word_embeddings is False


def test_dense_models_are_not_moe() -> None:
    assert not is_moe(load_config("tiny-llama", "cpu"))
    assert not is_moe({"num_experts": 0, "num_experts_per_tok": 2})
    assert is_moe({"num_local_experts": 8, "num_experts_per_tok": 2})


def test_gpu_size_builds_the_same_parameters_larger(model) -> None:
    from transformers import AutoModelForCausalLM

    cfg = load_config("tiny-moe", "gpu")
    with torch.device("meta"):
        big = AutoModelForCausalLM.from_config(cfg)
    small = {n: p.shape for n, p in model.named_parameters() if ".layers." not in n or ".layers.0." in n}
    large = {n: p.shape for n, p in big.named_parameters() if ".layers." not in n or ".layers.0." in n}
    assert small.keys() == large.keys()
    assert large["model.layers.0.mlp.experts.gate_up_proj"][0] == cfg.num_experts
    assert len(router_modules(big)) == cfg.num_hidden_layers


def test_every_parameter_follows_the_seeded_rule(cpu_config, model) -> None:
    """Norm weights 1, biases 0, everything else (router and fused experts included) N(0, 0.02) from the hash."""
    from pytest_gpuregress.training.models import build_causal_lm

    again = dict(build_causal_lm(cpu_config, seed=SEED).named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("mlp.gate.weight") for n in names)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert any(n.endswith("mlp.experts.down_proj") for n in names)
    for name, param in model.named_parameters():
        assert torch.equal(param, again[name]), f"{name} differs between two builds"
        values = param.detach().numpy()
        if name.endswith("norm.weight"):
            assert np.all(values == 1.0), name
            continue
        assert not name.endswith(".bias"), f"{name}: tiny-moe has no biases (qkv_bias false)"
        expected = seeded_normal(SEED, name, tuple(param.shape), cpu_config.initializer_range).astype(np.float32)
        np.testing.assert_array_equal(values, expected, err_msg=f"{name} is not from the seeded rule")


def test_expert_load_rows_sum_to_one_and_spread_over_experts(cpu_config, model, tokens) -> None:
    model.train()
    load = expert_load(model, tokens)
    assert load.shape == (cpu_config.num_hidden_layers, cpu_config.num_experts)
    np.testing.assert_allclose(load.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert np.all((load > 0.05).sum(axis=1) > 1), f"routing collapsed onto one expert: {load}"
    assert model.training  # expert_load evaluates in eval mode and restores the modes


def test_the_expert_load_is_averaged_on_the_ranks_device_as_nccl_needs(model, tokens, monkeypatch) -> None:
    # An NCCL-only group cannot reduce a CPU tensor: the load must reach all_reduce on the rank's device. The meta
    # device stands in for a GPU here.
    import torch.distributed as dist

    from pytest_gpuregress.training.moe import mean_expert_load

    seen: list[torch.device] = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: seen.append(tensor.device))
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    averaged = mean_expert_load(model, tokens, torch.device("meta"))
    assert seen == [torch.device("meta")] and averaged.device.type == "meta"
    on_cpu = mean_expert_load(model, tokens, torch.device("cpu"))  # the fake reduce leaves one rank's load: halved
    np.testing.assert_allclose(on_cpu.numpy() * 2, expert_load(model, tokens), rtol=0, atol=0)


def test_expert_load_matches_the_router_logits_transformers_returns(cpu_config, model, tokens) -> None:
    with torch.no_grad():
        out = model(input_ids=tokens, output_router_logits=True)
    assert out.loss is None  # no labels: the aux loss is reported, never added to a loss
    rows = []
    for logits in out.router_logits:
        chosen = torch.topk(logits, cpu_config.num_experts_per_tok, dim=-1).indices.reshape(-1)
        counts = np.bincount(chosen.numpy(), minlength=cpu_config.num_experts)
        rows.append(counts / counts.sum())
    np.testing.assert_array_equal(expert_load(model, tokens), np.array(rows))


def test_expert_load_sees_through_a_peft_wrapper(cpu_config, tokens) -> None:
    from peft import LoraConfig, get_peft_model

    from pytest_gpuregress.scenarios.lora import DEFAULT_TARGETS
    from pytest_gpuregress.scenarios.lora.adapter import targeted_modules
    from pytest_gpuregress.training.models import build_causal_lm

    base = build_causal_lm(cpu_config, seed=SEED)
    plain = expert_load(base, tokens)
    # Every default LoRA target exists: attention and the shared expert (the routed experts are fused 3-D parameters).
    found = {name.rsplit(".", 1)[-1] for name in targeted_modules(base, list(DEFAULT_TARGETS))}
    assert found == set(DEFAULT_TARGETS)
    wrapped = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=list(DEFAULT_TARGETS)))
    np.testing.assert_array_equal(expert_load(wrapped, tokens), plain)  # lora_B is zero: same routing


def test_router_and_experts_get_finite_gradients(model, tokens) -> None:
    from pytest_gpuregress.training.step import next_token_loss

    model.zero_grad(set_to_none=True)
    try:
        loss = next_token_loss(model, tokens)
        loss.backward()
        assert torch.isfinite(loss)
        grads = {n: p.grad for n, p in model.named_parameters()}
        missing = [n for n, g in grads.items() if g is None]
        assert not missing, f"no gradient for {missing}"
        assert all(torch.isfinite(g).all() for g in grads.values())
        for name, grad in grads.items():
            if name.endswith("mlp.gate.weight"):  # the router learns through the top-k weights
                assert grad.abs().sum() > 0, name
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # every expert got tokens
                assert all(grad[e].abs().sum() > 0 for e in range(grad.shape[0])), name
    finally:
        model.zero_grad(set_to_none=True)
