"""A user's token sample (--gpuregress-tokens): read without unpickling, checked against the vocabulary,
windowed deterministically, sharded like the synthetic data, and a reference of its own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pytest_gpuregress.errors import BadTokens
from pytest_gpuregress.resources import shipped_dir
from pytest_gpuregress.training.data import MarkovTokens, TokenFileBatches, rank_slice, token_source
from pytest_gpuregress.training.token_file import describe, load_tokens

from ..conftest import FSDP_ONLY, record_references


def save_npy(path: Path, values: np.ndarray) -> Path:
    np.save(path, values)
    return path


def test_npy_and_safetensors_read_as_one_int64_stream(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    ids = (np.arange(600) % 97).astype(np.int32).reshape(6, 100)
    assert np.array_equal(load_tokens(save_npy(tmp_path / "t.npy", ids)), ids.reshape(-1))
    save_file({"input_ids": ids, "attention_mask": np.ones_like(ids)}, str(tmp_path / "t.safetensors"))
    stream = load_tokens(tmp_path / "t.safetensors")
    assert stream.dtype == np.int64 and np.array_equal(stream, ids.reshape(-1))


@pytest.mark.parametrize(("name", "content", "says"), [
    ("missing.npy", None, "no such file"),
    ("floats.npy", np.zeros(100, dtype=np.float32), "holds float32, not integer token ids"),
    ("negative.npy", np.array([3, -1, 2]), "holds a negative id (-1)"),
    ("ids.txt", "1 2 3", "unknown file type '.txt'"),
    ("objects.npy", np.array([{"a": 1}], dtype=object), "not a readable .npy file"),
    ("torn.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "not a readable .safetensors file"),
])
def test_a_bad_file_is_one_error_naming_it_and_the_fix(tmp_path: Path, name: str, content: object, says: str) -> None:
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content, allow_pickle=True)  # an object array needs a pickle: reading must refuse it
        path = path.with_suffix(".npy") if path.suffix != ".npy" else path
    elif isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(BadTokens) as caught:
        load_tokens(path)
    assert str(caught.value).startswith(f"--gpuregress-tokens {path}: {says}")


def test_ids_outside_the_vocabulary_and_too_short_a_sample_are_refused(tmp_path: Path) -> None:
    path = save_npy(tmp_path / "big.npy", np.arange(1000))
    with pytest.raises(BadTokens, match="holds id 999, outside the vocabulary of 256 of the model; use ids below 256"):
        describe(path, 256, 64)
    with pytest.raises(BadTokens, match="holds 10 tokens, fewer than one sequence of 65"):
        describe(save_npy(tmp_path / "short.npy", np.arange(10)), 256, 64)
    described = describe(save_npy(tmp_path / "ok.npy", np.arange(1000) % 256), 256, 64)
    assert described["count"] == 1000 and len(described["sha256"]) == 64 and described["file"].endswith("ok.npy")


def test_windows_are_fixed_per_step_wrap_around_and_shard_like_the_synthetic_data() -> None:
    stream = np.arange(1000, dtype=np.int64) % 256
    data = TokenFileBatches(stream, 256, seq_len=64, global_batch=16)
    first = data.global_batch_at(0)
    assert first.shape == (16, 65) and np.array_equal(first[0], stream[:65])
    assert np.array_equal(first[1, 0], first[0, -1])  # windows overlap by the one label token
    assert np.array_equal(data.global_batch_at(3), TokenFileBatches(stream, 256, 64, 16).global_batch_at(3))
    late = data.global_batch_at(100)  # far past the end: wraps, never out of range
    assert late.shape == (16, 65) and late.max() < 256
    halves = [data.rank_batch(2, r, 2) for r in range(2)]
    assert np.array_equal(np.concatenate(halves), data.global_batch_at(2))
    synthetic = MarkovTokens(vocab_size=256, seq_len=64, global_batch=16)
    assert np.array_equal(synthetic.rank_batch(1, 1, 4), rank_slice(synthetic.global_batch_at(1), 1, 4))


def test_a_rank_refuses_a_file_that_changed_since_the_session_read_it(tmp_path: Path) -> None:
    path = save_npy(tmp_path / "t.npy", np.arange(1000) % 256)
    config = {"seq_len": 64, "global_batch": 16, "data_seed": 1, "tokens": describe(path, 256, 64)}
    assert isinstance(token_source(config, 256), TokenFileBatches)
    save_npy(path, np.arange(1000) % 255)
    with pytest.raises(BadTokens, match="changed since the session read it"):
        token_source(config, 256)
    assert isinstance(token_source({k: v for k, v in config.items() if k != "tokens"}, 256), MarkovTokens)


def test_the_option_without_a_model_of_yours_is_a_usage_error_before_anything_trains(tmp_path: Path,
                                                                                      pytester: pytest.Pytester) -> None:
    tokens = save_npy(tmp_path / "traffic.npy", np.arange(5_000) % 32_000)
    refused = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-tokens={tokens}",
                                 "--collect-only")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines([f"*--gpuregress-tokens {tokens}: feeds the models given with --gpuregress-model, "
                                  "and none is given (the built-in models train on their own synthetic data)*"])


@pytest.mark.slow
@pytest.mark.full_tier  # about 70 s, three sessions: the file's reading and refusals are tested fast above
def test_a_token_file_feeds_the_users_model_and_records_its_reference_and_a_bad_one_stops_the_session(
        tmp_path: Path, pytester: pytest.Pytester) -> None:
    # A user's model with a real tokenizer's vocabulary (32k), next to the built-in 256-token model.
    config = json.loads((shipped_dir("models") / "tiny-llama" / "cpu" / "config.json").read_text())
    (tmp_path / "tiny-llama-32k").mkdir()
    (tmp_path / "tiny-llama-32k" / "config.json").write_text(json.dumps({**config, "vocab_size": 32_000}))
    tokens = save_npy(tmp_path / "traffic.npy", (np.arange(50_000) * 7919 % 32_000).astype(np.int32))
    model = (f"--gpuregress-model={tmp_path / 'tiny-llama-32k'}",)
    selection = ("-k", FSDP_ONLY, "--gpuregress-steps=4", "--gpuregress-replicas=0", *model)
    refs = record_references(tmp_path, *selection, f"--gpuregress-tokens={tokens}")
    stored = json.loads((refs / "fsdp-tiny-llama-32k" / "cpu-gloo-w2-fp32" / "record.json").read_text())
    assert stored["config"]["tokens"]["count"] == 50_000
    builtin = json.loads((refs / "fsdp" / "cpu-gloo-w2-fp32" / "record.json").read_text())
    assert "tokens" not in builtin["config"]  # the built-in model keeps its synthetic data
    common = ("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={refs}", *selection)
    pytester.runpytest(*common, f"--gpuregress-tokens={tokens}").assert_outcomes(passed=2)
    # The synthetic data is another setup (the store's identity test: tests/reference/test_store.py): its reference is another.
    from pytest_gpuregress.reference.store import config_differences

    assert config_differences(stored["config"], {k: v for k, v in stored["config"].items() if k != "tokens"}) == [
        f"config tokens: reference {stored['config']['tokens']!r}, this run '<absent>'"]
    assert config_differences(stored["config"], {**stored["config"], "tokens": {**stored["config"]["tokens"],
                                                                        "file": "/elsewhere/traffic.npy"}}) == []
    bad = save_npy(tmp_path / "wide.npy", np.arange(32_100))
    refused = pytester.runpytest(*common, f"--gpuregress-tokens={bad}")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines([f"*--gpuregress-tokens {bad}: holds id 32099, outside the vocabulary of 32000 of "
                                  "model 'tiny-llama-32k'*"])
