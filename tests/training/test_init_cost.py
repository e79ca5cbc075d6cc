"""Building and seeding a model costs what it must and no more (training/meta_build.py, seeding.py, init_cache.py),
with the same bits as before: the library's own init never runs on real tensors, buffers hold the values a
plain build computes, and cached initial values are the computed ones, a damaged cache entry never used.

The old implementation is kept here, verbatim, as the reference the new one must match bit for bit."""

from __future__ import annotations

import fcntl
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from pytest_gpuregress.training import init_cache, seeding
from pytest_gpuregress.training.dropout import silence_modules, switch_off
from pytest_gpuregress.training.factory import FactoryModel
from pytest_gpuregress.training.init_cache import Entry, InitCache
from pytest_gpuregress.training.meta_build import without_init
from pytest_gpuregress.training.models import build_causal_lm, isolated_generators, load_config

# --- the implementation before meta builds and the cache, as it was -------------------------------------------

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def old_splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        return z ^ (z >> np.uint64(31))


def old_hash_words(*parts: np.ndarray | int) -> np.ndarray:
    acc = np.asarray(0, dtype=np.uint64)
    for part in parts:
        acc = old_splitmix64(acc ^ np.asarray(part, dtype=np.uint64))
    return acc


def old_unit_float(h: np.ndarray) -> np.ndarray:
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def old_seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    count = int(np.prod(shape)) if shape else 1
    key = zlib.crc32(name.encode())
    idx = np.arange((count + 1) // 2, dtype=np.uint64)
    u1 = old_unit_float(old_hash_words(seed, 10, key, idx))
    u2 = old_unit_float(old_hash_words(seed, 11, key, idx))
    radius = np.sqrt(-2.0 * np.log1p(-u1))
    z = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])[:count]
    return (z * std).reshape(shape)


def old_seed_parameters(model: Any, seed: int, std: float) -> None:
    gains = {f"{module_name}.weight" if module_name else "weight" for module_name, module in model.named_modules()
             if "Norm" in type(module).__name__}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name in gains:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = old_seeded_normal(seed, name, tuple(param.shape), std)
                param.copy_(torch.from_numpy(values).to(param.dtype))


def old_build_causal_lm(config: Any, seed: int) -> Any:
    switch_off(config)
    with isolated_generators(), torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config)
    silence_modules(model)
    old_seed_parameters(model, seed, float(getattr(config, "initializer_range", 0.02)))
    return model


# --- helpers ----------------------------------------------------------------------------------------------------

def assert_same_bits(new: Any, old: Any) -> None:
    """Every parameter and buffer (persistent or not) of two models equal bit for bit, with the same ties."""
    new_tensors = {**dict(new.named_parameters(remove_duplicate=False)), **dict(new.named_buffers(remove_duplicate=False))}
    old_tensors = {**dict(old.named_parameters(remove_duplicate=False)), **dict(old.named_buffers(remove_duplicate=False))}
    assert sorted(new_tensors) == sorted(old_tensors)
    for name, value in old_tensors.items():
        mine = new_tensors[name]
        assert mine.device.type == "cpu" and mine.dtype == value.dtype and mine.shape == value.shape, name
        assert torch.equal(mine.detach().reshape(-1).view(torch.uint8), value.detach().reshape(-1).view(torch.uint8)), name
    shared = lambda m: sorted(n for n, _ in m.named_parameters(remove_duplicate=False)  # noqa: E731
                              if n not in dict(m.named_parameters()))
    assert shared(new) == shared(old)


def tiny_gpt2() -> GPT2Config:
    return GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, initializer_range=0.02,
                      use_cache=False, bos_token_id=0, eos_token_id=0)


# --- the build -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llama-tied", "tiny-moe", "gpt2"])
def test_a_model_built_without_the_library_init_has_the_old_build_s_bits(model: str) -> None:
    config = (lambda: tiny_gpt2()) if model == "gpt2" else (lambda: load_config(model, "cpu"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(init_cache.VARIABLE, "off")
        assert_same_bits(build_causal_lm(config(), seed=5), old_build_causal_lm(config(), seed=5))


def test_the_library_init_never_touches_a_real_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaForCausalLM

    touched: list[str] = []
    real_init = LlamaForCausalLM._init_weights

    def watched(self: Any, module: Any) -> None:
        touched.extend(p.device.type for p in module.parameters(recurse=False))
        real_init(self, module)

    monkeypatch.setattr(LlamaForCausalLM, "_init_weights", watched)
    with torch.device("cpu"):
        AutoModelForCausalLM.from_config(load_config("tiny-llama", "cpu"))
    assert "cpu" in touched  # the watch sees the plain build's init at work
    touched.clear()
    model, fast = without_init(lambda: AutoModelForCausalLM.from_config(load_config("tiny-llama", "cpu")))
    assert fast and "cpu" not in touched  # it ran, if at all, on meta parameters: no draw, no memory written
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_model_that_cannot_be_built_on_meta_parameters_is_built_the_plain_way() -> None:
    class ReadsItsWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, 4))
            self.scale = float(self.weight.detach().sum())  # reads a value: impossible on meta

    class BufferFromWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.register_buffer("twice", self.weight.detach() * 2, persistent=False)  # would be left on meta

    class MaskFromWeight(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.mask = self.weight.detach() > 0  # a plain attribute, no buffer: would be left on meta

    for kind in (ReadsItsWeight, BufferFromWeight, MaskFromWeight):
        model, fast = without_init(kind)
        assert not fast and all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
        assert torch.equal(model.weight, torch.ones_like(model.weight))


def test_a_factory_model_is_seeded_as_before_with_or_without_meta_parameters(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(init_cache.VARIABLE, "off")
    (pytester.path / "facmodels.py").write_text(
        "import torch\n"
        "class Block(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = torch.nn.Linear(8, 8)\n"
        "        self.norm = torch.nn.LayerNorm(8)\n"
        "        self.register_buffer('steps', torch.arange(8.0), persistent=False)\n"
        "class Net(torch.nn.Module):\n"
        "    _no_split_modules = ['Block']\n"
        "    def __init__(self, strict=False):\n"
        "        super().__init__()\n"
        "        self.vocab_size = 16\n"
        "        self.embed = torch.nn.Embedding(16, 8)\n"
        "        self.blocks = torch.nn.ModuleList([Block()])\n"
        "        if strict:\n"
        "            self.gain = float(self.embed.weight.detach().abs().max())  # needs real values\n"
        "def plain():\n    return Net()\n"
        "def strict():\n    return Net(strict=True)\n")
    pytester.syspathinsert()
    for entry in ("facmodels:plain", "facmodels:strict"):
        factory = FactoryModel(entry)
        old = factory.empty()
        old_seed_parameters(old, 3, 0.02)
        assert_same_bits(factory.build(3), old)


# --- seeding and its cache -------------------------------------------------------------------------------------

SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 5), (257, 257)]  # 0-d, one element, odd counts, over MIN_CACHED


@pytest.mark.parametrize("shape", [*SHAPES, (0, 3), (2 * seeding.BLOCK + 3,), (3, 2 * seeding.BLOCK + 1)])
def test_seeded_normal_is_the_old_implementation_bit_for_bit(shape: tuple[int, ...]) -> None:
    # (257, 257) and the last two span blocks, the last one's end odd: the pairs' sine half starts mid-block.
    new, old = seeding.seeded_normal(11, "model.w", shape, 0.02), old_seeded_normal(11, "model.w", shape, 0.02)
    assert new.dtype == old.dtype == np.float64 and new.shape == old.shape == shape
    assert new.tobytes() == old.tobytes()


class Odd(torch.nn.Module):
    """Parameters of the shapes above, and those seeding fills with constants."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        for i, shape in enumerate(SHAPES):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty(shape, dtype=dtype)))
        self.norm = torch.nn.LayerNorm(3, dtype=dtype)
        self.lin = torch.nn.Linear(3, 2, dtype=dtype)


def seeded(cache: InitCache | None, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    model = Odd(dtype)
    seeding.seed_parameters(model, 4, 0.02, cache=cache)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def old_seeded(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    model = Odd(dtype)
    old_seed_parameters(model, 4, 0.02)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def assert_equal_bits(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> None:
    assert new.keys() == old.keys()
    for name in old:
        assert new[name].dtype == old[name].dtype and new[name].shape == old[name].shape, name
        assert torch.equal(new[name].reshape(-1).view(torch.uint8), old[name].reshape(-1).view(torch.uint8)), name


def cache_at(tmp_path: Path) -> InitCache:
    code = seeding.code_identity()
    assert code is not None
    return InitCache(tmp_path / "cache", code)


def test_every_cacheable_parameter_goes_through_the_cache_with_min_cached_lowered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seeding, "MIN_CACHED", 1)  # so the 0-d and one-element parameters are cached too
    cache = cache_at(tmp_path)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):  # bf16 is never cached: numpy has no bf16
        assert_equal_bits(seeded(cache, dtype), old_seeded(dtype))  # cold: computed and stored
        assert_equal_bits(seeded(cache, dtype), old_seeded(dtype))  # warm: read
    assert len(list(cache.root.rglob("*.safetensors"))) == 2 * (len(SHAPES) + 1)  # and lin.weight
    assert_equal_bits(seeded(None), old_seeded())


def test_a_warm_cache_is_read_not_computed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = cache_at(tmp_path)
    seeded(cache)
    assert len(list(cache.root.rglob("*.safetensors"))) == 1  # only (257, 257) is over MIN_CACHED
    real = seeding.seeded_normal
    computed: list[tuple[int, ...]] = []
    monkeypatch.setattr(seeding, "seeded_normal", lambda seed, name, shape, std: computed.append(shape) or
                        real(seed, name, shape, std))
    assert_equal_bits(seeded(cache), old_seeded())
    assert (257, 257) not in computed and (3, 5) in computed


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped bit":
        data[-3] ^= 0x10  # in the values
    elif how == "truncated":
        del data[len(data) // 2:]
    elif how == "not safetensors":
        data[:] = b"\x80\x04K\x01."  # a pickle
    elif how == "another key":
        data[:] = data.replace(b"\"seed\\\": 4", b"\"seed\\\": 5")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped bit", "truncated", "not safetensors", "another key"])
def test_a_damaged_cache_entry_is_recomputed_and_rewritten_never_used(tmp_path: Path, how: str) -> None:
    cache = cache_at(tmp_path)
    seeded(cache)
    (path,) = cache.root.rglob("*.safetensors")
    entry = Entry(4, "p5", (257, 257), 0.02, "float32")
    good = cache.load(entry)
    assert cache.path(entry) == path and good is not None
    damage(path, how)
    damaged = path.read_bytes()
    assert cache.load(entry) is None
    assert_equal_bits(seeded(cache), old_seeded())
    rewritten = cache.load(entry)  # written again, whole
    assert path.read_bytes() != damaged and rewritten is not None and rewritten.tobytes() == good.tobytes()


def test_the_cache_forgets_what_no_launch_used_lately_and_what_killed_ranks_left(tmp_path: Path) -> None:
    # It would only grow: every code change or numpy upgrade starts a new 0.6 GB set of entries per model and seed.
    import os
    import time

    cache = cache_at(tmp_path)
    used, old = Entry(1, "used", (3, 5), 0.02, "float32"), Entry(1, "old", (3, 5), 0.02, "float32")
    for entry in (used, old):
        cache.store(entry, np.ones((3, 5), dtype=np.float32))
    leftover = cache.path(used).with_name(".killed.tmp")
    leftover.write_bytes(b"half an entry")
    month_ago = time.time() - 30 * 86400
    for path in (cache.path(used), cache.path(old), leftover):
        os.utime(path, (month_ago, month_ago))
    assert cache.load(used) is not None  # a read marks it used
    assert cache.prune() == 2
    assert cache.path(used).exists() and not cache.path(old).exists() and not leftover.exists()


def test_an_entry_is_a_safetensors_file_any_reader_takes(tmp_path: Path) -> None:
    from safetensors import safe_open

    cache = cache_at(tmp_path)
    entry, values = Entry(1, "w", (3, 5), 0.02, "float32"), np.arange(15, dtype=np.float32).reshape(3, 5)
    cache.store(entry, values)
    with safe_open(str(cache.path(entry)), framework="np") as fh:
        assert fh.metadata()["sha256"] == init_cache.values_digest(values)
        assert fh.get_tensor(init_cache.TENSOR).tobytes() == values.tobytes()
    loaded = cache.load(entry)
    assert loaded is not None and loaded.tobytes() == values.tobytes()


def test_the_key_holds_seed_name_shape_std_dtype_and_code(tmp_path: Path) -> None:
    cache = cache_at(tmp_path)
    base = Entry(0, "w", (2, 3), 0.02, "float32")
    others = [Entry(1, "w", (2, 3), 0.02, "float32"), Entry(0, "v", (2, 3), 0.02, "float32"),
              Entry(0, "w", (3, 2), 0.02, "float32"), Entry(0, "w", (2, 3), 0.01, "float32"),
              Entry(0, "w", (2, 3), 0.02, "float64")]
    paths = {cache.path(e) for e in [base, *others]} | {InitCache(cache.root, "other code").path(base)}
    assert len(paths) == len(others) + 2


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(init_cache.VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert init_cache.default_root() == tmp_path / "xdg" / "pytest-gpuregress" / "init"
    monkeypatch.setenv(init_cache.VARIABLE, str(tmp_path / "mine"))
    assert init_cache.default_root() == tmp_path / "mine"
    monkeypatch.setenv(init_cache.VARIABLE, "off")
    assert init_cache.default_root() is None and seeding.default_cache() is None


def test_an_unwritable_cache_only_costs_the_computation(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    cache = InitCache(tmp_path / "file" / "cache", "code")  # a folder that cannot be made
    assert_equal_bits(seeded(cache), old_seeded())


def test_an_entry_another_process_is_computing_is_read_once_written(tmp_path: Path) -> None:
    cache = cache_at(tmp_path)
    busy, free = Entry(4, "busy", (2, 2), 0.02, "float32"), Entry(4, "free", (2, 2), 0.02, "float32")
    cache.root.mkdir(parents=True)
    lock_path = cache.path(busy).with_suffix(".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    other = open(lock_path, "w")  # another process's lock: flock locks belong to the open file
    fcntl.flock(other, fcntl.LOCK_EX)
    done: list[bool] = []
    computed: list[str] = []

    def compute(entry: Entry) -> np.ndarray:
        computed.append(entry.name)
        return np.full((2, 2), 1.0, dtype=np.float32)

    outs = {"busy": np.zeros((2, 2), np.float32), "free": np.zeros((2, 2), np.float32)}

    def fetch() -> None:
        init_cache.fetch(cache, [(busy, outs["busy"]), (free, outs["free"])], compute)
        done.append(True)

    worker = threading.Thread(target=fetch)
    worker.start()
    try:
        for _ in range(200):
            if computed:
                break
            threading.Event().wait(0.01)
        assert computed == ["free"]  # the free entry first; the busy one waits for its owner
        cache.store(busy, np.full((2, 2), 7.0, dtype=np.float32))  # what the other process computed
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
        other.close()
    worker.join(10)
    assert done and computed == ["free"] and float(outs["free"][0, 0]) == 1.0
    assert float(outs["busy"][0, 0]) == 7.0  # read, not computed again
