"""The models a session trains besides the built-in one: ``--gpuregress-model`` (ini ``gpuregress_models``).

A transformers config file or folder, a zoo model in ``models/`` by name, or a ``package.module:function``
factory; its name goes into test ids and reference folders. Torch-free except ``check_model``, which stops
the session at configure time when a model cannot be built or does not fit the device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadModel, UnsafeName
from ..reference.names import safe_component
from ..resources import shipped_dir
from .factory import factory_model, is_factory
from .models import config_path
from .observe import proc_bytes
from .projections import BlockProjections, PeftTargets, matches, peft_targets, survey

# fp32 weights, gradients and AdamW's two moments: 16 bytes a parameter, before activations. FSDP2 spreads
# them over the ranks; the accelerate LoRA lane keeps a whole fp32 copy of the frozen base on every rank.
TRAINING_BYTES_PER_PARAM = 16
REPLICA_BYTES_PER_PARAM = 4


@dataclass(frozen=True)
class ModelSpec:
    """One model the training scenarios run: its name (test ids, references) and where it comes from."""

    name: str
    source: str  # the config file's absolute path; a shipped model's folder under models/; a factory's entry
    shipped: bool = False  # one of models/ (tiny-moe, tiny-llama-tied): its size follows the device
    factory: bool = False  # package.module:function (training/factory.py)

    def config_file(self, device_kind: str) -> str:
        """The config file this device trains: a shipped model's cpu or gpu size, or the user's file."""
        return str(config_path(self.name, "gpu" if device_kind == "cuda" else "cpu")) if self.shipped else self.source

    def config_fields(self) -> dict[str, str]:
        """A scenario config's fields for it: its name, and its config file or factory (a zoo model: by name)."""
        where = {"model_factory": self.source} if self.factory else {} if self.shipped else {"model_file": self.source}
        return {"model": self.name, **where}

    def module_names(self, device_kind: str) -> frozenset[str]:
        """Every module's full name (what LoRA targets match, as peft does: the name or a dotted suffix of it)."""
        if self.factory:
            return factory_model(self.source).module_names
        return module_names(self.config_file(device_kind))

    def peft_targets(self, device_kind: str, targets: Sequence[str]) -> PeftTargets | None:
        """What peft adapts for ``targets``; None for a factory's model (no architecture peft converts)."""
        return None if self.factory else peft_targets_of(self.config_file(device_kind), tuple(targets))

    def projections(self, device_kind: str) -> BlockProjections:
        """The linear projections of its decoder layers: what the lora scenario targets by default."""
        if self.factory:
            return factory_model(self.source).projections
        return block_projections(self.config_file(device_kind))


def parse_model(value: str, base: Path) -> ModelSpec:
    """``value`` from the command line or ini file: a factory, a config file or its folder (relative to ``base``),
    or a zoo model's name (``tiny-moe``)."""
    text = value.strip()
    if is_factory(text) and not (base / text).exists():
        return ModelSpec(_named(text.rsplit(":", 1)[1], text), text, factory=True)
    shipped = shipped_dir("models") / text
    if "/" not in text and text not in (".", "..") and (shipped / "cpu" / "config.json").is_file():  # the zoo, by name
        if (base / text).exists():
            raise BadModel(text, f"is both a model of the zoo and a path in {base}",
                           f"write ./{text} for the path, or rename it")
        return ModelSpec(_named(text, str(shipped)), str(shipped), shipped=True)
    return _config_file(text, base)


def _config_file(text: str, base: Path) -> ModelSpec:
    """A user's config file, or the folder holding its config.json, relative to ``base``."""
    path = (base / text).resolve()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise BadModel(text, "no such config file", "pass a transformers config.json, or the folder holding it")
    # models/<name>/<size>/config.json (the layout of models/) is named <name>; <folder>/config.json <folder>
    folder = path.parent.parent if path.parent.name in ("cpu", "gpu") else path.parent
    name = folder.name if path.name == "config.json" else path.stem
    return ModelSpec(_named(name, str(path)), str(path))


# Names a model may not take: launch keys and case ids the training scenarios already use.
RESERVED = frozenset({"default", "fsdp", "lora", "fully_shard", "accelerate", "tiny-llama"})
RESERVED_PREFIXES = ("triage-", "flip-", "replica-")  # the launch keys of triage, flips and noise replicas


def _named(name: str, source: str) -> str:
    rename = "rename the function (its name is the model's name)" if is_factory(source) else \
        "rename the file (its stem is the model's name)"
    try:
        safe_component(name, "model name")
    except UnsafeName as exc:
        raise BadModel(source, str(exc), rename) from None
    if name in RESERVED or name.startswith(RESERVED_PREFIXES):
        raise BadModel(source, f"would be named {name!r}, a name the scenarios use themselves", rename)
    return name


def parse_models(values: list[str], base: Path) -> tuple[ModelSpec, ...]:
    specs = tuple(parse_model(v, base) for v in values if v.strip())
    names = [s.name for s in specs]
    for name in {n for n in names if names.count(n) > 1}:
        sources = [s.source for s in specs if s.name == name]
        raise BadModel(sources[1], f"has the name {name!r} of another model ({sources[0]})",
                       "give the models distinct names (config file stems, factory function names)")
    return specs


def check_model(spec: ModelSpec, device_kind: str, world_size: int = 1) -> None:
    """Build the config and the model on the meta device; check its parameter count against this device's memory."""
    if spec.factory:
        _check_size(spec.source, factory_model(spec.source).parameters, device_kind, world_size)  # on the meta device
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = spec.config_file(device_kind)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; all mean "cannot build this"
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise BadModel(source, f"transformers cannot build a causal LM from it ({type(exc).__name__}: {first})",
                       "use a config of a causal LM architecture this transformers version has") from None
    if not getattr(config, "vocab_size", None):
        raise BadModel(source, "has no vocab_size", "add vocab_size to the config")
    _check_size(source, sum(p.numel() for p in model.parameters()), device_kind, world_size)


def _check_size(source: str, params: int, device_kind: str, world_size: int) -> None:
    """One rank's share (the larger of FSDP2's shard of the training state and a whole replica of the weights)
    against one GPU's free memory; on the CPU every rank's share against the machine's."""
    share = max(params * TRAINING_BYTES_PER_PARAM // max(world_size, 1), params * REPLICA_BYTES_PER_PARAM)
    need = share if device_kind == "cuda" else share * max(world_size, 1)
    have = available_memory(device_kind)
    where = "each GPU" if device_kind == "cuda" else f"the {world_size} CPU ranks"
    if have is not None and need > have:
        raise BadModel(source, f"has {params / 1e6:.1f} M parameters: training them takes about "
                               f"{need / 2**30:.1f} GiB for {where} (weights, gradients, AdamW state), this "
                               f"{device_kind} has {have / 2**30:.1f} GiB",
                       "use a smaller model (fewer layers or a smaller hidden size)")


def available_memory(device_kind: str) -> int | None:
    """Bytes for one rank's model: the smallest local GPU's total memory (asking for free memory would open a
    context on every GPU, taking memory the ranks need), or the machine's available RAM."""
    if device_kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        return min(int(torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count()))
    return proc_bytes("MemAvailable", "/proc/meminfo")


def _built_on_meta(source: str) -> Any:
    """The model a config file describes, built on the meta device (no memory for its weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source, local_files_only=True))


# Once per file, read only: a wrap changes a model in place (``_built_on_meta`` gives one to change).
_meta_model = functools.lru_cache(maxsize=16)(_built_on_meta)


@functools.lru_cache(maxsize=16)
def module_names(source: str) -> frozenset[str]:
    """Every module's full name (``model.layers.0.self_attn.q_proj``) in a config file's model: LoRA's match set."""
    return frozenset(name for name, _ in _meta_model(source).named_modules() if name)


@functools.lru_cache(maxsize=16)
def block_projections(source: str) -> BlockProjections:
    """The linear projections of the decoder layers of the model a config file describes (training/projections.py)."""
    return survey(_meta_model(source))


@functools.lru_cache(maxsize=16)
def peft_targets_of(source: str, targets: tuple[str, ...]) -> PeftTargets:
    """What peft adapts for ``targets`` in the model a config file describes (training/projections.py)."""
    return peft_targets(_built_on_meta(source), targets)  # peft wraps in place: never the cached model


def targets_present(targets: list[str], names: frozenset[str]) -> list[str]:
    """The LoRA targets that name a module, matched as peft does (``projections.matches``)."""
    return [t for t in targets if any(matches(t, n) for n in names)]
