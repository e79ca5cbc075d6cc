"""Scenario ``fsdp``: fixed-seed FSDP2 training of a tiny Llama, compared with its stored reference.

Session side: the configuration per device. The training loop itself is in ``rank.py``.
"""

from __future__ import annotations

from typing import Any

from ...reference.record import RunRecord
from ..base import Case, Launch, Scenario, Setup

# Per-size defaults. The CPU size runs 300 steps in well under a minute on two cores.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"model_size": "cpu", "dtype": "fp32", "global_batch": 16, "seq_len": 64, "lr": 3e-3},
    "cuda": {"model_size": "gpu", "dtype": "bf16", "global_batch": 48, "seq_len": 256, "lr": 6e-4},
}
COMMON: dict[str, Any] = {
    "model": "tiny-llama",
    "steps": 300,
    "seed": 0,
    "data_seed": 1234,
    "warmup_steps": 20,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "grad_clip": 1.0,
}


def training_config(setup: Setup, common: dict[str, Any], per_device: dict[str, dict[str, Any]],
                    model: str | None = None) -> dict[str, Any]:
    """A training scenario's config: common values, the device's, the steps asked for, the model's identity.

    ``model``: the name of a user's model (--gpuregress-model) to train instead of the scenario's own."""
    from ...training.models import architecture_of
    from ...training.token_file import describe_for

    config = dict(common)
    config.update(per_device["cuda" if setup.device_kind == "cuda" else "cpu"])
    if setup.steps is not None:
        config["steps"] = int(setup.steps)
    if model is not None:  # the name is its identity with the digest below; the file is where it lives here
        config.update(setup.model(model).config_fields())
        switched = dropout_off(setup, model)
        if switched:  # training/dropout.py; a model without dropout keeps its config and its references
            config["dropout_off"] = switched
    config["model_architecture"] = architecture_of(config)
    tokens = describe_for(config, setup.tokens)  # a user's token sample replaces the synthetic data
    if tokens is not None:
        config["tokens"] = tokens
    return config


def dropout_off(setup: Setup, model: str) -> dict[str, float]:
    """The stochastic config fields training switches off for a user's model (none for a factory's: its dropout
    modules are silenced on the ranks, and its code is not a config file to read here)."""
    from ...training.dropout import config_file_dropout

    spec = setup.model(model)
    return {} if spec.factory else dict(config_file_dropout(spec.config_file(setup.device_kind)))


class FsdpScenario(Scenario):
    name = "fsdp"
    step0_sharded = True  # each rank records its shard (rank.py): merge() assembles the tensors
    rank_entry = "pytest_gpuregress.scenarios.fsdp.rank:run"
    supports_triage = True
    trains_user_models = True

    def default_config(self, setup: Setup) -> dict[str, Any]:
        return training_config(setup, COMMON, DEVICE_DEFAULTS)

    def model_config(self, setup: Setup, model: str | None) -> dict[str, Any]:
        """The config with ``model`` (a user's, by name) in place of the tiny Llama; None: the default."""
        return training_config(setup, COMMON, DEVICE_DEFAULTS, model)

    def header(self, setup: Setup) -> list[str]:
        """Per model with dropout or router jitter: that training runs with it switched off, and why."""
        from ...training.dropout import describe

        return [f"gpuregress dropout ({m.name}): switched off for training ({describe(switched)}): masks differ "
                "between one rank and two and with what a library drew while building the model (docs/own-models.md)"
                for m in setup.models if (switched := dropout_off(setup, m.name))]

    def cases(self, setup: Setup) -> list[Case]:
        # The tiny Llama keeps the id and reference "fsdp"; each model of --gpuregress-model adds "fsdp-<model>".
        return [Case(self.name), *(Case(m.name, launch=m.name, data={"model": m.name}) for m in setup.models)]

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        keys = dict.fromkeys(c.launch for c in cases)
        return [Launch(key, self.model_config(setup, None if key == "default" else key)) for key in keys]

    def noise_replicas(self, launch: Launch, setup: Setup, count: int) -> list[Launch]:
        return perturbed_launches(launch, setup, count)

    def step0_terms(self, config: dict[str, Any]) -> tuple[int, int]:
        from ...training.models import blueprint

        # Through transformers: a GPT-2 config says n_layer, and its config class maps num_hidden_layers to it.
        layers = blueprint(config).num_hidden_layers
        return int(config["global_batch"]) * int(config["seq_len"]), int(layers)

    def properties(self, case: Case, record: RunRecord, setup: Setup) -> dict[str, Any]:
        """An MoE model's expert load: the busiest expert's share of the routed token slots (1/experts when even)."""
        load = record.results.get("expert_load")
        return {"busiest_expert_share": round(max(max(row) for row in load), 4)} if load else {}

    def message_of(self, param: str, shapes: dict[str, tuple[int, ...]], world_size: int,
                   record: RunRecord | None = None) -> str:
        return reduce_scatter_message(param, shapes, world_size, record)


def _group(param: str) -> str:
    """The name-pattern guess at a parameter's fully_shard group (Llama's ``model.layers.N``, else the root):
    only for records that predate their units (``recorded_units``)."""
    parts = param.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2:
        return f"decoder layer {parts[2]}"
    return "the root group"


def recorded_units(record: RunRecord | None) -> dict[str, dict[str, Any]] | None:
    """The fully_shard units ``record`` kept (rank.py); None for an older record, which lacks them."""
    from ...training.shard_units import RESULT_KEY

    units = record.results.get(RESULT_KEY) if record is not None else None
    return units if isinstance(units, dict) else None


def reduce_scatter_message(param: str, shapes: dict[str, tuple[int, ...]], world_size: int,
                           record: RunRecord | None = None) -> str:
    """The reduce-scatter that carries ``param``'s gradient: one per fully_shard unit, fp32 (the reduce dtype),
    each parameter padded on dim 0 to a multiple of the world size, as FSDP2 shards it.

    The unit is the one ``record``'s run really wrapped ``param`` in; a record without units (older than
    them) falls back to the name pattern of ``_group``, which knows Llama's layers only."""
    from ...training.shard_units import group_label, reduce_scatter_bytes, unit_of
    from ...units import human_bytes

    units = recorded_units(record)
    path = unit_of(param, units) if units else None
    if units and record is not None and path is not None:  # a parameter the units do not list falls back too
        unit = units[path]
        # The recorded size holds at the record's world size; at another (triage's one rank), recount it.
        size = unit["bytes"] if record.world_size == world_size else \
            reduce_scatter_bytes(unit["params"], shapes, world_size)
        return f"reduce-scatter of {group_label(path)}, {human_bytes(int(size))}"
    group = _group(param)
    members = [name for name in shapes if _group(name) == group]
    return f"reduce-scatter of {group}, {human_bytes(reduce_scatter_bytes(members, shapes, world_size))}"


def perturbed_launches(launch: Launch, setup: Setup, count: int) -> list[Launch]:
    """The noise replicas of a training launch: its config with a ``perturbation`` the rank code applies."""
    from ...training.noise import replica_plan

    return [Launch(f"replica-{perturbation}", {**launch.config, "perturbation": perturbation}, {**launch.env, **env})
            for perturbation, env in replica_plan(count, setup.device_kind)]


SCENARIO = FsdpScenario()
