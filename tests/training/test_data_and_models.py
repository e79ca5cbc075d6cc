"""Deterministic data and seeded initialisation: same everywhere, independent of world size."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pytest_gpuregress.training.counter_rng import hash_words, splitmix64
from pytest_gpuregress.training.data import MarkovTokens
from pytest_gpuregress.training.models import architecture_digest, load_config, model_dir, seeded_normal


def test_splitmix64_known_value() -> None:
    # First output of the reference splitmix64 generator seeded with 0.
    assert int(splitmix64(np.asarray(0, dtype=np.uint64))) == 0xE220A8397B1DCDAF


def test_hash_depends_on_every_part() -> None:
    assert int(hash_words(1, 2, 3)) != int(hash_words(1, 2, 4)) != int(hash_words(2, 2, 3))


def test_global_batch_is_independent_of_world_size() -> None:
    data = MarkovTokens(vocab_size=64, seq_len=16, global_batch=8, seed=7)
    whole = data.global_batch_at(3)
    for world in (1, 2, 4, 8):
        parts = np.concatenate([data.rank_batch(3, r, world) for r in range(world)])
        np.testing.assert_array_equal(parts, whole)


def test_data_is_reproducible_and_differs_by_step() -> None:
    data = MarkovTokens(vocab_size=64, seq_len=16, global_batch=4)
    np.testing.assert_array_equal(data.global_batch_at(0), data.global_batch_at(0))
    assert not np.array_equal(data.global_batch_at(0), data.global_batch_at(1))
    assert data.global_batch_at(0).min() >= 0 and data.global_batch_at(0).max() < 64


def test_data_follows_the_chain_so_it_is_learnable() -> None:
    data = MarkovTokens(vocab_size=64, seq_len=32, global_batch=16)
    table = data.successors()
    tokens = data.global_batch_at(0)
    for row in tokens:
        for prev, nxt in zip(row[:-1], row[1:]):
            assert nxt in table[prev]
    assert data.entropy_floor() < 0.5 * math.log(64)


def test_uneven_world_size_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        MarkovTokens(vocab_size=8, seq_len=4, global_batch=8).rank_batch(0, 0, 3)


def test_seeded_normal_is_deterministic_and_normal() -> None:
    a = seeded_normal(0, "w", (200, 50), 0.02)
    np.testing.assert_array_equal(a, seeded_normal(0, "w", (200, 50), 0.02))
    assert not np.array_equal(a, seeded_normal(0, "v", (200, 50), 0.02))
    assert abs(a.mean()) < 1e-3 and abs(a.std() - 0.02) < 1e-3


def test_model_configs_ship_in_both_sizes() -> None:
    cpu, gpu = load_config("tiny-llama", "cpu"), load_config("tiny-llama", "gpu")
    assert cpu.num_key_value_heads < cpu.num_attention_heads  # GQA
    assert gpu.hidden_size > cpu.hidden_size
    assert architecture_digest("tiny-llama", "cpu") != architecture_digest("tiny-llama", "gpu")


def test_architecture_digest_ignores_version_stamps_but_not_the_architecture(tmp_path) -> None:
    import json

    shipped = json.loads((model_dir("tiny-llama", "cpu") / "config.json").read_text())
    digests = {}
    for label, change in {"same": {}, "stamped": {"transformers_version": "9.9.9", "torch_dtype": "bfloat16"},
                          "wider": {"hidden_size": 128}}.items():
        folder = tmp_path / label
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**shipped, **change}))
        digests[label] = architecture_digest(str(folder), "cpu")
    assert digests["same"] == digests["stamped"] == architecture_digest("tiny-llama", "cpu")
    assert digests["wider"] != digests["same"]


def test_unknown_model_names_the_file() -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model/cpu/config.json"):
        model_dir("no-such-model", "cpu")


def test_build_is_identical_across_builds() -> None:
    torch = pytest.importorskip("torch")
    from pytest_gpuregress.training.models import build_causal_lm

    cfg = load_config("tiny-llama", "cpu")
    a, b = build_causal_lm(cfg, seed=3), build_causal_lm(cfg, seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    c = build_causal_lm(cfg, seed=4)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


# Pinned digests: data and initial weights must be the same on every machine and library version,
# which a comparison within one process cannot show. They change only with the generator itself.
DATA_SHA256 = {
    0: "541b71d198ae456277b8caf49121b93253cd17c3ce8b0e9022039e45404abc87",
    5: "bd3f3eb48d1b456403b1661c3b3cf5203d5523b22f0b3122c2dce279fdcfb93e",
}
WEIGHTS_SHA256 = "25e55e374e37f016e0078d81fab1be73fce5c38f2bf7ce4de0b16e3ae627a498"


@pytest.mark.parametrize("step", sorted(DATA_SHA256))
def test_data_bytes_are_pinned(step: int) -> None:
    import hashlib

    tokens = MarkovTokens(vocab_size=256, seq_len=64, global_batch=16, seed=1234).global_batch_at(step)
    assert hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest() == DATA_SHA256[step]


def test_initial_weights_are_pinned() -> None:
    import hashlib

    pytest.importorskip("torch")
    from pytest_gpuregress.training.models import build_causal_lm

    model = build_causal_lm(load_config("tiny-llama", "cpu"), seed=0)
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().float().numpy().tobytes())
    assert digest.hexdigest() == WEIGHTS_SHA256


def test_the_gpu_size_parameter_count_the_checkpoint_sizes_quote_is_the_gpu_models() -> None:
    """fsdp's and lora's resume plans say what their GPU checkpoints weigh from this one number."""
    import torch
    from transformers import AutoModelForCausalLM

    from pytest_gpuregress.training.models import TINY_LLAMA_GPU_PARAMETERS, load_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config("tiny-llama", "gpu"))
    assert sum(p.numel() for p in model.parameters()) == TINY_LLAMA_GPU_PARAMETERS
