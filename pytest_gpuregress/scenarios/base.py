"""What a scenario is: the one interface every built-in and plug-in scenario implements.

The session side is torch-free (imported at collection) and knows nothing of pytest: the plugin drives it
through ``Scenario``. Only the rank side (``rank.py`` in each scenario folder) imports torch. What each
member is for: docs/writing-a-scenario.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..activities import Exercises
from ..findings import Problem
from ..kinds import Backend, DeviceKind
from ..reference.record import RunRecord

if TYPE_CHECKING:
    from ..comparison.compare import Comparison
    from ..fault_points import FaultSpec
    from ..option_spec import OptionSpec
    from ..training.model_specs import ModelSpec

StepHook = Callable[[int, int], None]  # (rank, step) -> None; faults use it to hang or crash
Runner = Callable[["Scenario", "Launch"], RunRecord]  # the session's run of a launch (cached), as a scenario calls it


def test_id(scenario: str, case_id: str) -> str:
    """A case's test id (its pytest name, and its node id after ``gpuregress::``): ``fsdp``, ``formats-io-dcp``,
    ``lora-fully_shard-tiny-qwen2``: the scenario's name, then the case's own id where it has one."""
    return case_id if case_id == scenario else f"{scenario}-{case_id}" if case_id else scenario


@dataclass(frozen=True)
class Setup:
    """What a scenario may know of the session: where it runs, the steps asked for, faults, its options."""

    device_kind: DeviceKind
    backend: Backend
    world_size: int
    steps: int | None = None
    faults: tuple[FaultSpec, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    tokens: Path | None = None  # --gpuregress-tokens: a user's token sample for the training scenarios
    models: tuple[ModelSpec, ...] = ()  # --gpuregress-model: models every training scenario runs besides its own
    replicas: int = 3  # --gpuregress-replicas: noise replicas of a recording (training/noise.py DEFAULT_REPLICAS)

    def option(self, name: str) -> Any:
        """The value of this scenario's ``--gpuregress-<name>`` option (None when unset and no default)."""
        return self.options.get("gpuregress_" + name.replace("-", "_"))

    def model(self, name: str) -> ModelSpec:
        """The model of --gpuregress-model named ``name`` (case data and launch keys carry the name)."""
        return next(m for m in self.models if m.name == name)


@dataclass(frozen=True)
class Case:
    """One test case of a scenario. ``launch`` names the launch that carries it."""

    id: str
    marks: tuple[str, ...] = ()
    launch: str = "default"
    data: dict[str, Any] = field(default_factory=dict)
    # Ranks the case needs (2 for collectives and sharding); below it the case is collected and skipped with the reason.
    min_ranks: int = 1
    # What it runs (activities.py), so faults that act on none of it skip it (faults/reach.py). None (a plug-in's
    # case): every fault counts as reaching it.
    exercises: Exercises | None = field(default=None, compare=False)
    # The column it shares in docs/faults.md's table with cases like it (the sweep's "collectives"); "": its id.
    family: str = field(default="", compare=False)

    def identity(self) -> dict[str, Any]:
        """What names the case, as JSON (a kept run stores it to be judged again): not what it exercises."""
        return {"id": self.id, "marks": list(self.marks), "launch": self.launch, "data": self.data,
                "min_ranks": self.min_ranks}


@dataclass(frozen=True)
class Launch:
    """One group of ranks: the config every rank receives, and extra environment for this group only. ``world_size``
    and ``entry`` override the platform's and the scenario's, for another scenario's code at another size."""

    key: str
    config: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    world_size: int | None = None
    entry: str | None = None
    inject: bool = True  # False: --gpuregress-inject does not apply (the float64 oracle is no stack under test)
    fresh_ranks: bool = False  # True: new processes, never pooled ones (a resume must prove nothing survives in memory)
    # True: never a pooled process (a triage replay): a bug that needs a warmed-up process must not ride into one side
    # of a comparison only. Under torchrun it runs in place as it is.
    cold: bool = False


@dataclass
class RankContext:
    """Everything rank-side scenario code needs to know about where it runs."""

    rank: int
    world_size: int
    local_rank: int
    device_kind: DeviceKind
    backend: Backend
    config: dict[str, Any]
    run_dir: Path
    fingerprint: dict[str, Any] = field(default_factory=dict)
    step_hooks: list[StepHook] = field(default_factory=list)
    teardown_hooks: list[Callable[[], None]] = field(default_factory=list)  # after results are delivered
    cleanup_hooks: list[Callable[[], None]] = field(default_factory=list)  # undo installed faults
    progress_path: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)  # --gpuregress-fail-fast: the reference, per step
    stopped: dict[str, Any] | None = None  # the step fail-fast stopped at, and why
    profile: bool = True  # take a kernel inventory of a few steady steps (training/observe.py)
    # The training step running now (training/loop.py sets it); None outside training. Faults that start late read it.
    current_step: int | None = None
    # The digest of the token batch this rank read last (training/step.py): summed over ranks, a step's global batch.
    batch_digest: float | None = None

    @property
    def device(self) -> str:
        return f"cuda:{self.local_rank}" if self.device_kind == "cuda" else "cpu"

    def progress(self, label: str) -> None:
        """Append a progress line; the last one is reported if this rank hangs."""
        if self.progress_path is not None:
            with open(self.progress_path, "a") as fh:
                fh.write(label + "\n")

    def step_done(self, step: int, **values: float) -> bool:
        """After each completed step (``values``: its global loss, grad_norm): records progress, lets injected faults fire;
        True where --gpuregress-fail-fast found the values outside the reference's tolerance and the run should stop."""
        self.progress(f"step {step} done" + "".join(f", {k} {v:.6g}" for k, v in values.items()))
        for hook in self.step_hooks:
            hook(self.rank, step)
        if self.watch and self.stopped is None:
            from ..comparison.failfast import first_miss, peer_miss

            miss = first_miss(self.watch, step, values)
            # Ranks stop together or not at all: one that stopped alone (a faulty collective gave it other values)
            # would leave its peers waiting in the next step's collective.
            if self.watch.get("agree") and self.world_size > 1 and self._any_rank(miss is not None):
                miss = miss or peer_miss(self.watch, step)
            self.stopped = miss
        return self.stopped is not None

    def _any_rank(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        from ..fault_points import plugin_own_collectives

        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        with plugin_own_collectives():  # fail-fast's vote is the plugin's, not the training's: no fault acts on it
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value) > 0.5


class TriageSupport:
    """What triage (pytest_gpuregress/triage) needs of a training scenario, composed by one that supports it
    (``triage = FsdpTriage()``), as torchtitan composes a model's spec: the scenario interface stays small, and
    a scenario without it is simply not triaged."""

    def step0_terms(self, config: dict[str, Any]) -> tuple[int, int]:
        """(tokens summed into each step-0 gradient, layers deep): the terms of triage's derived bound."""
        raise NotImplementedError

    def message_of(self, param: str, shapes: dict[str, tuple[int, ...]], world_size: int,
                   record: RunRecord | None = None) -> str:
        """The collective message that carries ``param``'s gradient, e.g. "reduce-scatter of the root group, 128 KiB";
        ``record``: a run whose results may say how it grouped its parameters."""
        return "an unknown collective"


class Scenario:
    """Base class with the defaults of a one-case training scenario; see the module docstring."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "training"
    rank_entry: ClassVar[str] = ""
    options: ClassVar[tuple[OptionSpec, ...]] = ()
    # True: each rank records its dim-0 shard of the step-0 gradients (fsdp), which merge() concatenates.
    step0_sharded: ClassVar[bool] = False

    def default_config(self, setup: Setup) -> dict[str, Any]:
        """The configuration this scenario runs with; stored with its references."""
        config: dict[str, Any] = {}
        if setup.steps is not None:
            config["steps"] = setup.steps
        return config

    # True: it also trains each model of --gpuregress-model (cases, launches, references of their own: model_config).
    trains_user_models: ClassVar[bool] = False

    def model_config(self, setup: Setup, model: str | None) -> dict[str, Any]:
        """The config with a user's model (``--gpuregress-model``, by name; None: ``default_config``) in place of the
        scenario's own; scenarios with ``trains_user_models`` override it."""
        if model is not None:
            raise NotImplementedError(f"scenario {self.name!r} does not train user models")
        return self.default_config(setup)

    def platform_tag(self, config: dict[str, Any]) -> str:
        """Short tag for the reference folder, e.g. the compute dtype."""
        return str(config.get("dtype", "fp32"))

    def cases(self, setup: Setup) -> list[Case]:
        return [Case(self.name)]

    def launches(self, cases: list[Case], setup: Setup) -> list[Launch]:
        """Group the selected ``cases`` into launches; each case's ``launch`` must name one of them."""
        return [Launch("default", self.default_config(setup))]

    def noise_replicas(self, launch: Launch, setup: Setup, count: int) -> list[Launch]:
        """Up to ``count`` launches of ``launch`` with legitimate perturbations, run when a reference is
        recorded; their spread is the noise envelope (training/noise.py). [] records no envelope."""
        return []

    # --- evidence and triage ------------------------------------------------------------------------

    # What triage needs of a training scenario it can explain (see TriageSupport); None: triage does not run.
    triage: ClassVar[TriageSupport | None] = None
    # A check scenario whose results in the same session are evidence on a failure of another scenario: the
    # component they speak for (the collective sweep: "collective"), and what to call them in a verdict.
    evidence_for: ClassVar[str | None] = None
    evidence_name: ClassVar[str] = ""

    def experiment(self, case: Case, run: Runner, setup: Setup) -> RunRecord | None:
        """Run ``case``'s launches through ``run`` (cached per key) into one record for ``own_findings``, for cases
        that need several launches or another scenario's; None (the default): the usual launch."""
        return None

    def attachments(self, case: Case, record: RunRecord, run: Runner, setup: Setup) -> dict[str, Path]:
        """Recording only: folders by name to store in ``case``'s reference beside ``record`` (e.g. a checkpoint a later
        comparison resumes from); ``run`` runs the launches that takes. {} by default."""
        return {}

    def from_reference(self, case: Case, reference: Callable[[], RunRecord],
                       run: Runner, setup: Setup) -> RunRecord | None:
        """Comparing only: the run of ``case`` from its reference's stored state (``reference()`` reads it, verified, with
        its attachments), or NotApplicable; None (the default): the usual launch or ``experiment``."""
        return None

    def oracle_launch(self, setup: Setup, model: str | None) -> Launch | None:
        """The float64 oracle of step 0 whose distance a recording stores, for ``model`` (None: the scenario's own).
        None (the default): triage's oracle where the scenario composes TriageSupport, else none."""
        return None

    def triage_explains(self, case: Case) -> bool:
        """Whether triage's experiments, which rerun training from step 0, may explain a failure of ``case``."""
        return self.triage is not None

    def merge(self, records: list[RunRecord]) -> RunRecord:
        """Combine the per-rank records (index = rank): rank 0's, with the largest peak memory, every rank's host ops and
        op trace, and (``step0_sharded``) the step-0 gradients assembled from every rank's shard."""
        from ..evidence import introduced, op_trace
        from ..training.observe import merge_ranks

        merged = records[0]
        merged.results.update(merge_ranks(records))
        traced, traced_arrays = op_trace.merge_ranks(records)  # every rank's step-0 op trace, where it keeps one
        introduced.attach_thresholds(traced)  # what "introduced a difference" means, kept with a reference
        merged.results.update(traced)
        merged.arrays.update(traced_arrays)
        if self.step0_sharded:
            from ..evidence import step0

            merged.arrays.update(step0.merge_ranks(records))
        return merged

    def unsupported(self, case: Case, record: RunRecord, setup: Setup) -> str | None:
        """Why this stack cannot run ``case`` (its backend lacks an op the case needs), or None: such a case is
        skipped as not supported, never judged, since nothing was computed."""
        return None

    def own_findings(self, case: Case, record: RunRecord, setup: Setup) -> list[Problem]:
        """Reference-free findings for ``case``: a complete message, or a check's finding that triage names (a
        ``CheckFinding``); [] when clean."""
        return []

    def properties(self, case: Case, record: RunRecord, setup: Setup) -> dict[str, Any]:
        """Key figures of ``case`` for JUnit properties (e.g. ``wrong_elements``); the comparison adds its own."""
        return {}

    def reference_name(self, case: Case) -> str | None:
        """The stored reference ``case`` is compared with (a folder under the reference root), or None: training
        scenarios compare every case, a check scenario may compare some. Cases of one launch may share one."""
        if self.kind != "training":
            return None
        return case.id if case.id == self.name else f"{self.name}-{case.id}"  # namespaced: never another scenario's

    # A Comparator subclass of its own (comparator.py), for a judgement ``own_findings`` and ``compare`` cannot express.
    comparator_type: ClassVar[type | None] = None

    def compare(self, reference: RunRecord, record: RunRecord, case: Case, lane: str) -> Comparison:
        """Compare ``record`` with its reference for ``case``. By default: losses, gradients and weights."""
        from ..comparison.compare import compare_training
        from ..training.models import ties_embeddings

        return compare_training(reference, record, lane=lane, tied=ties_embeddings(record.config))

    def header(self, setup: Setup) -> list[str]:
        """Lines for the report header, e.g. a setting that does not apply on this platform."""
        return []

    def artifacts(self, key: str, record: RunRecord, setup: Setup) -> dict[str, str]:
        """Extra text files (name -> content) saved beside a launch's record in the artifacts folder."""
        return {}

    def summary(self, records: dict[str, RunRecord | None], setup: Setup) -> list[str]:
        """Lines for this scenario's terminal summary, given its launches' records by key (None: it failed)."""
        return []


class CheckScenario(Scenario):
    """A scenario whose cases are judged by closed-form verdicts, with no stored reference."""

    kind: ClassVar[str] = "check"
