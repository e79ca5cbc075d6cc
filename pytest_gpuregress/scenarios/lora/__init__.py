"""Scenario ``lora``: peft LoRA training through accelerate, with the adapter round-tripped.

Two cases, each its own launch and reference (reference_runs/lora/<platform>-<wrapper>/):
  lora-fully_shard the peft model under torch's FSDP2 (``fully_shard``), directly (wrapper "fsdp2")
  lora-accelerate  through ``Accelerator.prepare``: accelerate's FSDP2 plugin on GPUs, DDP on the CPU
Both record what ``fsdp`` records (adapter parameters only) and run the LoRA checks of checks.py,
which ``verdict()`` reports as findings of their own. Session side, torch-free; training is rank.py.
"""

from __future__ import annotations

from typing import Any

from ...plugin.options import LORA_DEFAULT_TARGETS, SCENARIO_OPTIONS
from ...reference.record import RunRecord
from ..base import Case, Launch, Scenario, Setup
from ..fsdp import COMMON as FSDP_COMMON
from ..fsdp import perturbed_launches, training_config

DEFAULT_TARGETS = LORA_DEFAULT_TARGETS
WRAPPERS = ("fsdp2", "accelerate")
CASE_IDS = {"fsdp2": "fully_shard", "accelerate": "accelerate"}
# LoRA trains few parameters from a zero lora_B: a larger learning rate than full fine-tuning, no decay.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"model_size": "cpu", "dtype": "fp32", "global_batch": 16, "seq_len": 64, "lr": 1e-2},
    "cuda": {"model_size": "gpu", "dtype": "bf16", "global_batch": 48, "seq_len": 256, "lr": 2e-3},
}
COMMON: dict[str, Any] = {**FSDP_COMMON, "weight_decay": 0.0, "lora_r": 8, "lora_alpha": 16}


class LoraScenario(Scenario):
    name = "lora"
    rank_entry = "pytest_gpuregress.scenarios.lora.rank:run"
    options = SCENARIO_OPTIONS["lora"]  # declared with the plugin's: pytest reads them without importing this

    trains_user_models = True

    def default_config(self, setup: Setup) -> dict[str, Any]:
        return self.model_config(setup, None)

    def model_config(self, setup: Setup, model: str | None) -> dict[str, Any]:
        from ...training.model_specs import targets_present

        config = training_config(setup, COMMON, DEVICE_DEFAULTS, model)
        asked = setup.option("lora-targets")
        if model is None and not asked:  # the defaults are the tiny Llama's names: no model to build here
            config["target_modules"] = list(DEFAULT_TARGETS)
            return config
        # One option serves every model: each targets the names it has (q_proj for a Llama, c_attn for a
        # GPT-2), so adding a model's names never changes another's config. None at all: NotApplicable.
        targets = list(asked or DEFAULT_TARGETS)
        config["target_modules"] = targets_present(targets, _module_names(setup, model)) or targets
        return config

    def platform_tag(self, config: dict[str, Any]) -> str:
        # One reference folder per wrapper under reference_runs/lora/, e.g. cpu-gloo-w2-fp32-fsdp2.
        return f"{config.get('dtype', 'fp32')}-{config['wrapper']}"

    def cases(self, setup: Setup) -> list[Case]:
        # Ids name the API, not "fsdp2": `-k fsdp` selects the fsdp scenario, not this one. A user's model
        # adds its name: lora-fully_shard-mymoe.
        return [Case(CASE_IDS[wrapper] + (f"-{model}" if model else ""), launch=wrapper + (f"-{model}" if model else ""),
                     data={"wrapper": wrapper, "model": model})
                for model in [None, *(m.name for m in setup.models)] for wrapper in WRAPPERS]

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        return [Launch(case.launch, {**self.model_config(setup, case.data["model"]), "wrapper": case.data["wrapper"]})
                for case in cases]

    def experiment(self, case: Case, run: Any, setup: Setup) -> RunRecord | None:
        """None (the usual launch), after checking the model has modules the adapter can target."""
        from ...errors import NotApplicable
        from ...training.model_specs import targets_present

        model = case.data.get("model")
        if model is None and not setup.option("lora-targets"):
            return None  # the defaults are the tiny Llama's own names
        targets = self.model_config(setup, model)["target_modules"]
        if not targets_present(targets, _module_names(setup, model)):
            where = "the tiny Llama" if model is None else \
                f"model {model!r} ({setup.model(model).source})"
            raise NotApplicable(f"{where} has no module named {', '.join(targets)}; list every model's projections "
                                f"in --gpuregress-lora-targets (e.g. {','.join(DEFAULT_TARGETS[:2])},c_attn for a "
                                "Llama and a GPT-2): each model targets the names it has")
        return None

    def reference_name(self, case: Case) -> str:
        # The wrapper is in the platform key, so `-k lora` records and finds both; a user's model has its own.
        return self.name if not case.data.get("model") else f"{self.name}-{case.data['model']}"

    def noise_replicas(self, launch: Launch, setup: Setup, count: int) -> list[Launch]:
        return perturbed_launches(launch, setup, count)

    def merge(self, records: list[RunRecord]) -> RunRecord:
        """Rank 0's record with every rank's LoRA findings: a problem on one rank only is not lost."""
        from .checks import merge_findings

        merged = super().merge(records)
        merged.results["lora_checks"] = merge_findings(r.results.get("lora_checks", []) for r in records)
        return merged

    def verdict(self, case: Case, record: RunRecord, setup: Setup) -> list[str]:
        from .checks import CHECKS, format_findings

        problems = format_findings(record.results.get("lora_checks", []))
        missing = sorted(set(CHECKS) - set(record.results.get("lora_checks_run", [])))
        if missing:  # each check runs in every run; one that did not run cannot have passed
            problems.append(f"[checkpoint] lora checks did not run: {', '.join(missing)}")
        return problems


def _module_names(setup: Setup, model: str | None) -> frozenset[str]:
    """What LoRA can target in ``model`` (a user's, by name; None: the tiny Llama)."""
    from ...training.model_specs import module_names
    from ...training.models import config_path

    if model is None:
        size = DEVICE_DEFAULTS["cuda" if setup.device_kind == "cuda" else "cpu"]["model_size"]
        return module_names(str(config_path(COMMON["model"], size)))
    return setup.model(model).module_names(setup.device_kind)


SCENARIO = LoraScenario()
