"""Scenario ``fsdp``: fixed-seed FSDP2 training of a tiny Llama, compared with its stored reference.

Session side: the configuration per device; training is rank.py. ``fsdp-resume`` resumes the reference's own
checkpoint on this stack (``RESUME`` below, shared/resume_*.py; docs/checkpoint.md).
"""

from __future__ import annotations

from typing import Any

from ... import activities as act
from ...findings import CheckFinding, Problem
from ...option_spec import SCENARIO_OPTIONS
from ...reference.record import RunRecord
from ...training.models import TINY_LLAMA_GPU_PARAMETERS
from ..base import Case, Launch, Scenario, Setup, TriageSupport
from ..shared import resume_comparison
from ..shared.exercised import ties_embeddings, trained
from ..shared.replicas import perturbed_launches
from ..shared.resume_plan import ResumePlan, with_resume
from ..shared.training_config import COMMON, dropout_off, per_device, training_config

# Per-size defaults. The CPU size runs 300 steps in well under a minute on two cores. grad_clip 0.5: the tiny
# Llama's median gradient norm on the CPU, so about half the steps clip (the GPU size: not yet measured; the
# recording prints the share). AdamW's fused kernel: torchtitan's default with FSDP2.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = per_device(cpu={"lr": 3e-3, "grad_clip": 0.5},
                                                        cuda={"lr": 6e-4, "grad_clip": 0.5})
TRAINING: dict[str, Any] = {**COMMON, "adamw": "fused"}
# The CPU's bf16 lane (case ``bf16``, reference ``fsdp/<cpu>-bf16``): the CPU size with bf16 parameters over fp32
# master weights and gradients reduce-scattered in bf16, so bf16 casts, bf16 matmuls and bf16 reductions run on
# every machine. GPUs train in bf16 already (their default lane), with fp32 reduction.
# 100 steps: bf16 rounds on every step, and the lane keeps the main job within its time.
BF16_LANE = "bf16"
BF16: dict[str, Any] = {"dtype": "bf16", "reduce_dtype": "bf16", "bf16_checkpoint": True}  # training/bf16_checkpoint.py
BF16_STEPS = 100
# fsdp-resume: the tiny Llama's case (launch "default") continued from its reference's checkpoint (with_resume).
GPU_BYTES_PER_PARAMETER = 12  # fp32 weights, exp_avg and exp_avg_sq (FSDP2 keeps fp32 shards under bf16 compute)
RESUME = ResumePlan("pytest_gpuregress.scenarios.fsdp.rank:resume", "weights and AdamW's two moments, 12 bytes per "
                    f"parameter: about {GPU_BYTES_PER_PARAMETER * TINY_LLAMA_GPU_PARAMETERS / 1e9:.1f} GB for the "
                    "156 M-parameter model", resumes=lambda case: case.launch == "default")


class FsdpTriage(TriageSupport):
    """Triage of fsdp's training (and of a user's model in it): its step-0 bound's terms and its messages."""

    def step0_terms(self, config: dict[str, Any]) -> tuple[int, int]:
        from ...training.models import blueprint

        # Through transformers: a GPT-2 config says n_layer, and its config class maps num_hidden_layers to it.
        layers = blueprint(config).num_hidden_layers
        return int(config["global_batch"]) * int(config["seq_len"]), int(layers)

    def message_of(self, param: str, shapes: dict[str, tuple[int, ...]], world_size: int,
                   record: RunRecord | None = None) -> str:
        """The reduce-scatter that carries ``param``'s gradient: one per fully_shard unit ``record``'s run wrapped,
        in the run's reduce dtype (fp32, or bf16 in the CPU bf16 lane), each parameter padded on dim 0 to a multiple
        of the world size, as FSDP2 shards it."""
        from ...training.fsdp2 import RESULT_KEY, group_label, reduce_dtype_of, reduce_scatter_bytes, unit_of
        from ...units import human_bytes

        units = record.results.get(RESULT_KEY) if record is not None else None  # the units rank.py kept
        path = unit_of(param, units) if isinstance(units, dict) else None  # None without a record, too
        if path is None:  # no size guessed: a size is what triage reasons from
            why = "not among the run's recorded units" if isinstance(units, dict) else "the run recorded no units"
            return f"reduce-scatter of the fully_shard unit that holds it ({why})"
        unit = units[path]
        # The recorded size holds at the record's world size; at another (triage's one rank), recount it.
        size = unit["bytes"] if record.world_size == world_size else \
            reduce_scatter_bytes(unit["params"], shapes, world_size, reduce_dtype_of(record.config))
        word = "bf16 " if reduce_dtype_of(record.config) == "bf16" else ""  # the CPU bf16 lane; fp32 says nothing
        return f"{word}reduce-scatter of {group_label(path)}, {human_bytes(int(size))}"


class FsdpScenario(Scenario):
    name = "fsdp"
    step0_sharded = True  # each rank records its shard (rank.py): merge() assembles the tensors
    rank_entry = "pytest_gpuregress.scenarios.fsdp.rank:run"
    triage = FsdpTriage()
    trains_user_models = True
    options = SCENARIO_OPTIONS["fsdp"]  # declared with the plugin's: pytest reads them without importing this

    def default_config(self, setup: Setup) -> dict[str, Any]:
        return training_config(setup, TRAINING, DEVICE_DEFAULTS)

    def model_config(self, setup: Setup, model: str | None) -> dict[str, Any]:
        """The config with ``model`` (a user's, by name) in place of the tiny Llama; None: the default."""
        return training_config(setup, TRAINING, DEVICE_DEFAULTS, model)

    def header(self, setup: Setup) -> list[str]:
        """Per model with dropout or router jitter: that training runs with it switched off, and why."""
        from ...training.dropout import describe

        return [f"gpuregress dropout ({m.name}): switched off for training ({describe(switched)}): masks differ "
                "between one rank and two and with what a library drew while building the model (docs/own-models.md)"
                for m in setup.models if (switched := dropout_off(setup, m.name))]

    def cases(self, setup: Setup) -> list[Case]:
        # The tiny Llama keeps the id and reference "fsdp" (and its resume case "fsdp-resume", with_resume's); each
        # model of --gpuregress-model adds "fsdp-<model>"; the CPU adds its bf16 lane, "fsdp-bf16".
        adamw = TRAINING["adamw"]
        bf16 = [Case(BF16_LANE, launch=BF16_LANE, exercises=trained(
            setup, adamw=adamw, bf16=True, more=(act.bf16_reduction(), act.BF16_READ_BACK)))] \
            if setup.device_kind == "cpu" else []
        return [Case(self.name, exercises=self._exercised(setup, None)), *bf16,
                *(Case(m.name, launch=m.name, data={"model": m.name}, exercises=self._exercised(setup, m.name),
                       family=self.name) for m in setup.models)]

    def _exercised(self, setup: Setup, model: str | None) -> act.Exercises:
        """Its training of ``model``; a model whose config ties its embeddings runs transformers' tying too."""
        tied = (act.TIED_CONFIG,) if ties_embeddings(setup, model) else ()
        return trained(setup, adamw=TRAINING["adamw"], more=tied, model=model)

    def reference_name(self, case: Case) -> str | None:
        # The bf16 lane is the fsdp reference in another dtype: its folder is fsdp/<platform>-bf16.
        return self.name if case.launch == BF16_LANE else super().reference_name(case)

    def own_findings(self, case: Case, record: RunRecord, setup: Setup) -> list[Problem]:
        """The bf16 lane's checkpoint round trip (training/bf16_checkpoint.py); nothing for the other cases."""
        from ...training import bf16_checkpoint

        if not record.config.get(bf16_checkpoint.CONFIG_KEY) or record.results.get(resume_comparison.LOADED_KEY):
            return []
        result = record.results.get(bf16_checkpoint.RESULT_KEY)
        if result is None:  # asked for, so it must have run: one that did not cannot have passed
            return [CheckFinding("checkpoint", "bf16 checkpoint of the trained weights: the round trip did not run")]
        return bf16_checkpoint.findings(result)

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        keys = dict.fromkeys(c.launch for c in cases)
        return [Launch(key, self._launch_config(key, setup)) for key in keys]

    def _launch_config(self, key: str, setup: Setup) -> dict[str, Any]:
        if key == BF16_LANE:
            steps = {} if setup.steps is not None else {"steps": BF16_STEPS}  # --gpuregress-steps sets every lane's
            return {**self.default_config(setup), **BF16, **steps}
        return self.model_config(setup, None if key == "default" else key)

    def noise_replicas(self, launch: Launch, setup: Setup, count: int) -> list[Launch]:
        return perturbed_launches(launch, setup, count)

    def properties(self, case: Case, record: RunRecord, setup: Setup) -> dict[str, Any]:
        """An MoE model's expert load: the busiest expert's share of the routed token slots (1/experts when even)."""
        load = record.results.get("expert_load")
        return {"busiest_expert_share": round(max(max(row) for row in load), 4)} if load else {}


SCENARIO = with_resume(FsdpScenario, RESUME)()
