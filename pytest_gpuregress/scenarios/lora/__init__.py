"""Scenario ``lora``: peft LoRA training, the adapter round-tripped. Cases ``lora-fully_shard`` (torch's FSDP2
directly) and ``lora-accelerate`` (``Accelerator.prepare``), each with its own reference and a ``-resume`` case
(``RESUME``), both running the LoRA checks of checks.py. Session side, torch-free; training is rank.py. docs/lora.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import activities as act
from ...errors import NotApplicable
from ...findings import CheckFinding, Problem
from ...option_spec import LORA_DEFAULT_TARGETS, SCENARIO_OPTIONS
from ...reference.record import RunRecord
from ...training.models import TINY_LLAMA_GPU_PARAMETERS
from ..base import Case, Launch, Runner, Scenario, Setup
from ..shared.exercised import trained
from ..shared.replicas import perturbed_launches
from ..shared.resume_plan import ResumePlan, with_resume
from ..shared.training_config import COMMON as TRAINING_COMMON
from ..shared.training_config import per_device, training_config

if TYPE_CHECKING:  # for annotations only: the session side imports model code when it needs it
    from ...training.projections import BlockProjections

DEFAULT_TARGETS = LORA_DEFAULT_TARGETS
CASE_IDS = {"fsdp2": "fully_shard", "accelerate": "accelerate"}
# LoRA trains few parameters from a zero lora_B: a larger learning rate than full fine-tuning, no decay.
# grad_clip 0.2: below the adapter's median gradient norm on the CPU (0.22), so most steps clip.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = per_device(cpu={"lr": 1e-2, "grad_clip": 0.2},
                                                        cuda={"lr": 2e-3, "grad_clip": 0.2})
# AdamW's implementation per wrapper, as their users run it: torch's default on GPUs (foreach) with fully_shard,
# the HF Trainer's default (fused) with accelerate.
ADAMW_OF_WRAPPER = {"fsdp2": "foreach", "accelerate": "fused"}
COMMON: dict[str, Any] = {**TRAINING_COMMON, "weight_decay": 0.0, "lora_r": 8, "lora_alpha": 16}

# On a CPU accelerate wraps the model in DDP: its collectives are all_reduce and broadcast, and its state dict holds
# whole tensors, so there is no shard to lose. On GPUs it runs FSDP2, as fully_shard does.
CPU_DDP_OPS = ("all_reduce", "broadcast")
NO_SHARDS_ON_CPU = "on a CPU accelerate runs DDP, whose state dict holds whole tensors: no slice to lose (FSDP2 on GPUs)"
# lora-<wrapper>-resume: the tiny Llama's cases (no user model) continued from their references' checkpoints, after
# every other case (with_resume). On GPUs the checkpoint holds the frozen base in fp32 and the adapter (r 8 on its 7
# projections in 8 layers: 8 x (in + out) per projection) with AdamW's two moments.
GPU_ADAPTER_PARAMETERS = 1_163_264
GPU_BYTES = 4 * TINY_LLAMA_GPU_PARAMETERS + 12 * GPU_ADAPTER_PARAMETERS
RESUME = ResumePlan("pytest_gpuregress.scenarios.lora.rank:resume", "the frozen base weights, 4 bytes per parameter, "
                    f"and the adapter with AdamW's two moments: about {GPU_BYTES / 1e9:.2f} GB for the 156 M-parameter "
                    "model", resumes=lambda case: not case.data.get("model"), last=True)


def exercised(setup: Setup, wrapper: str, model: str | None = None) -> act.Exercises:
    """What a LoRA case trains through ``wrapper``: peft's layers, the adapter saved from its shards under FSDP2."""
    ddp = wrapper == "accelerate" and setup.device_kind == "cpu"
    return trained(setup, adamw=ADAMW_OF_WRAPPER[wrapper], collectives=CPU_DDP_OPS if ddp else (act.ANY,), model=model,
                   more=(act.PEFT_LORA, act.ADAPTER_SAVE, *(() if ddp else (act.ADAPTER_SHARDS,)),
                         *((act.ACCELERATE_BACKWARD,) if wrapper == "accelerate" else ())),
                   absent={act.ADAPTER_SHARDS: NO_SHARDS_ON_CPU} if ddp else None)

class LoraScenario(Scenario):
    name = "lora"
    rank_entry = "pytest_gpuregress.scenarios.lora.rank:run"
    options = SCENARIO_OPTIONS["lora"]  # declared with the plugin's: pytest reads them without importing this

    trains_user_models = True

    def default_config(self, setup: Setup) -> dict[str, Any]:
        return self.model_config(setup, None)

    def model_config(self, setup: Setup, model: str | None) -> dict[str, Any]:
        config = training_config(setup, COMMON, DEVICE_DEFAULTS, model)
        config["target_modules"] = self.targets(setup, model)
        return config

    def targets(self, setup: Setup, model: str | None) -> list[str]:
        """The target_modules of ``model`` (a user's, by name; None: the tiny Llama)."""
        from ...training.model_specs import targets_present

        asked = setup.option("lora-targets")
        if not asked:
            # DEFAULT_TARGETS are every projection of the tiny Llama (tests check it): its references keep them,
            # with no model to build here. Any other model: every linear projection of its blocks, fused ones too.
            return list(DEFAULT_TARGETS) if model is None else list(_projections(setup, model).targets)
        # One option serves every model: each targets the names it has (q_proj for a Llama, c_attn for a
        # GPT-2), so adding a model's names never changes another's config. None at all: NotApplicable.
        return targets_present(list(asked), _module_names(setup, model)) or list(asked)

    def platform_tag(self, config: dict[str, Any]) -> str:
        # One reference folder per wrapper under reference_runs/lora/, e.g. cpu-gloo-w2-fp32-fsdp2.
        return f"{config.get('dtype', 'fp32')}-{config['wrapper']}"

    def cases(self, setup: Setup) -> list[Case]:
        # Ids name the API, not "fsdp2" (`-k fsdp` selects the fsdp scenario); a user's model adds its name:
        # lora-fully_shard-mymoe. The tiny Llama's resume cases come last (with_resume): lora-fully_shard-resume.
        return [Case(CASE_IDS[wrapper] + (f"-{model}" if model else ""), launch=wrapper + (f"-{model}" if model else ""),
                     data={"wrapper": wrapper, "model": model}, exercises=exercised(setup, wrapper, model),
                     family=f"{self.name}-{CASE_IDS[wrapper]}" if model else "")
                for model in [None, *(m.name for m in setup.models)] for wrapper in CASE_IDS]

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        # A resume case names its wrapper's launch: one launch per key.
        data = {case.launch: case.data for case in cases}
        return [Launch(key, {**self.model_config(setup, d["model"]), "wrapper": d["wrapper"],
                             "adamw": ADAMW_OF_WRAPPER[d["wrapper"]]}) for key, d in data.items()]

    def experiment(self, case: Case, run: Runner, setup: Setup) -> RunRecord | None:
        """None (the usual launch), after checking the model has modules the adapter can target."""
        from ...training.model_specs import targets_present

        model = case.data.get("model")
        if model is None and not setup.option("lora-targets"):
            return None  # the defaults are the tiny Llama's own names
        where = "the tiny Llama" if model is None else f"model {model!r} ({setup.model(model).source})"
        targets = self.targets(setup, model)
        if not targets:  # only the defaults can be empty: the user's targets are kept even when none is present
            raise NotApplicable(f"{where} has no Linear or Conv1D in its decoder layers for LoRA to target; name "
                                "modules to adapt with --gpuregress-lora-targets")
        if not targets_present(targets, _module_names(setup, model)):
            raise NotApplicable(f"{where} has no module named {', '.join(targets)}; list every model's projections "
                                f"in --gpuregress-lora-targets (e.g. {','.join(DEFAULT_TARGETS[:2])},c_attn for a "
                                "Llama and a GPT-2): each model targets the names it has")
        return None

    def header(self, setup: Setup) -> list[str]:
        """Per model, what the adapter targets, and what of its blocks' projections it leaves out and why."""
        return [line for model in [None, *(m.name for m in setup.models)] for line in self.target_lines(setup, model)]

    def target_lines(self, setup: Setup, model: str | None) -> list[str]:
        """The header lines of one model (None: the tiny Llama)."""
        from ...training.model_specs import targets_present
        from ...training.projections import left_out

        label = "tiny-llama" if model is None else model
        asked = bool(setup.option("lora-targets"))
        targets = self.targets(setup, model)
        if model is None and not asked:  # DEFAULT_TARGETS are all of the tiny Llama's projections: none left out
            return [f"gpuregress lora targets ({label}): {', '.join(targets)}"]
        # The user's targets are kept when the model has none of them: lora is then not applicable (experiment).
        present = targets_present(targets, _module_names(setup, model)) if targets else []
        lines = [f"gpuregress lora targets ({label}): {_describe_targets(targets, present)}"]
        peft, said = _peft_layout(setup, model, present, label)
        lines += said
        missed = left_out(_projections(setup, model), present, asked, peft)
        if missed:
            lines.append(f"gpuregress lora left out ({label}): "
                         + "; ".join(f"{why}: {', '.join(paths)}" for why, paths in missed.items()))
        return lines

    def reference_name(self, case: Case) -> str:
        # The wrapper is in the platform key, so `-k lora` records and finds both; a user's model has its own.
        return self.name if not case.data.get("model") else f"{self.name}-{case.data['model']}"

    def oracle_launch(self, setup: Setup, model: str | None) -> Launch | None:
        from .oracle import launch

        return launch(self.model_config(setup, model))

    def noise_replicas(self, launch: Launch, setup: Setup, count: int) -> list[Launch]:
        return perturbed_launches(launch, setup, count)

    def merge(self, records: list[RunRecord]) -> RunRecord:
        """Rank 0's record with every rank's LoRA findings: a problem on one rank only is not lost."""
        from .checks import merge_findings

        merged = super().merge(records)
        merged.results["lora_checks"] = merge_findings(r.results.get("lora_checks", []) for r in records)
        return merged

    def own_findings(self, case: Case, record: RunRecord, setup: Setup) -> list[Problem]:
        from .checks import CHECKS, shown_findings

        problems: list[Problem] = [*shown_findings(record.results.get("lora_checks", []))]
        missing = sorted(set(CHECKS) - set(record.results.get("lora_checks_run", [])))
        if missing:  # each check runs in every run; one that did not run cannot have passed
            problems.append(CheckFinding("lora-missing", f"lora checks did not run: {', '.join(missing)}"))
        return problems


def _module_names(setup: Setup, model: str | None) -> frozenset[str]:
    """What LoRA can target in ``model`` (a user's, by name; None: the tiny Llama)."""
    from ...training.model_specs import module_names

    if model is None:
        return module_names(str(_tiny_llama_config(setup)))
    return setup.model(model).module_names(setup.device_kind)


def _peft_layout(setup: Setup, model: str | None, present: list[str], label: str) -> tuple[Any, list[str]]:
    """How peft wraps a user's model with these targets (None for the tiny Llama or no target), and the header lines
    that say where it could not or where it moved them."""
    if model is None or not present:
        return None, []
    try:
        peft = setup.model(model).peft_targets(setup.device_kind, present)
    except Exception as exc:  # noqa: BLE001 - peft refuses these targets: the lora cases will say so when they run
        return None, [f"gpuregress lora peft ({label}): could not wrap the model with these targets "
                      f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"]
    if peft is not None and peft.moved:
        return peft, [f"gpuregress lora peft moved ({label}): {', '.join(peft.moved)} onto the fused expert "
                      f"parameters {', '.join(peft.into)} (target_parameters, transformers 5's MoE layout)"]
    return peft, []


def _describe_targets(targets: list[str], present: list[str]) -> str:
    """A model's targets for the header: the names, or why there are none to adapt."""
    if present:
        return ", ".join(targets)
    if not targets:
        return "none (no Linear or Conv1D in its decoder layers): lora is not applicable"
    return f"none ({', '.join(targets)}: no module of that name): lora is not applicable"


def _projections(setup: Setup, model: str | None) -> BlockProjections:
    """The linear projections of ``model``'s decoder layers (None: the tiny Llama's), from a build on the meta device."""
    from ...training.model_specs import block_projections

    if model is None:
        return block_projections(str(_tiny_llama_config(setup)))
    return setup.model(model).projections(setup.device_kind)


def _tiny_llama_config(setup: Setup) -> Path:
    """The built-in model's config file at this device's size."""
    from ...training.models import config_path

    size = DEVICE_DEFAULTS["cuda" if setup.device_kind == "cuda" else "cpu"]["model_size"]
    return config_path(COMMON["model"], size)


SCENARIO = with_resume(LoraScenario, RESUME)()
