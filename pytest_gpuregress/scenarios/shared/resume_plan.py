"""Session side of a resume from a reference's own checkpoint (fsdp-resume, lora's resume cases), as one wrapper,
``with_resume(Scenario, ResumePlan(...))``: what a recording stores beside the reference, the launch that continues
from it, the comparator. The ``resume-save`` launch is separate, so the reference's numbers are those of a run
without it. torch-free.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ...comparison.judgement import Judgement
from ...errors import NotApplicable
from ...evidence import step0
from ...findings import Problem
from ...reference.record import RunRecord
from ...stack.platforms import launched_by_torchrun
from ...units import human_bytes
from ..base import Case, Launch, Runner, Scenario, Setup, test_id
from ..comparator import Comparator
from . import late_gradients, resume_comparison
from .exercised import resumed
from .late_gradients import LATE_ONLY
from .resume_roles import FOLDER, RESULT_KEY, ROLE, resume_step
from .state_pieces import merge_boundaries

if TYPE_CHECKING:
    from ...comparison.compare import Comparison

PART = "resume"  # a resume case's data["part"]
ATTACHMENT = "resume"  # the folder inside the reference


def is_resume(case: Case) -> bool:
    return case.data.get("part") == PART


def late_window_case(sc: Scenario, case: Case, setup: Setup) -> Case | None:
    """The resume case that continues ``case``'s reference from its late checkpoint (same launch, same
    reference), which judges a divergence of ``case`` that starts after step 0; None where it has none."""
    return None if is_resume(case) else resume_of(sc, case, setup)


def resume_of(sc: Scenario, case: Case, setup: Setup) -> Case | None:
    """The resume case on ``case``'s launch and reference (``case`` itself where it is one); None: it has none."""
    return next((c for c in sc.cases(setup) if is_resume(c) and c.launch == case.launch
                 and sc.reference_name(c) == sc.reference_name(case)), None)


def launch_key(role: str, case: Case) -> str:
    """``resume-<role>``, then the case's launch where a scenario has several (lora: one per wrapper)."""
    return f"resume-{role}" if case.launch == "default" else f"resume-{role}-{case.launch}"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _note_nondeterminism(record: RunRecord, saved: RunRecord, start: int, label: str) -> None:
    """A note where the checkpoint's own run did not repeat ``record``'s first ``start`` losses bit for bit."""
    first, again = record.series.get("loss", [])[:start], saved.series.get("loss", [])
    if [float(x).hex() for x in first] == [float(x).hex() for x in again]:
        return
    step = next((i for i, (a, b) in enumerate(zip(first, again)) if float(a).hex() != float(b).hex()), len(again))
    record.notes.append(f"resume checkpoint: its run's first {start} steps are not bitwise this run's (from "
                        f"step {step}): this stack is not deterministic, so the checkpoint is a neighbour of "
                        f"the reference's state, and {label} judges from it within tolerances")


@dataclass(frozen=True)
class ResumePlan:
    """A scenario's resume from its reference: the rank entry of its two launches (resume_roles.Roles), and what
    the checkpoint holds on GPUs, said in the skip where it is off."""

    entry: str
    gpu_size: str  # e.g. "weights and AdamW's two moments, 12 bytes per parameter: about 1.9 GB for ..."
    resumes: Callable[[Case], bool]  # the scenario's cases whose references keep a checkpoint and get ``<case>-resume``
    last: bool = False  # the resume cases after every case (lora's); False: each after its case (fsdp's)

    def off_here(self, setup: Setup) -> str | None:
        """Why the resume checkpoint is neither recorded nor resumed on this device; None where it is."""
        if setup.device_kind != "cuda" or setup.option("resume-checkpoint"):
            return None
        return (f"on GPUs the resume checkpoint is optional for its size ({self.gpu_size}): record and compare it "
                "with --gpuregress-resume-checkpoint")


class ResumeComparator(Comparator):
    """The default judgement, but a resume case's continuation is judged (and plotted, and kept) against the
    reference's steps from its checkpoint on."""

    def row_label(self, reference_name: str) -> str:
        # A continuation shares its reference's folder: the row says it is the resume (fsdp-resume).
        if self.scenario is not None and self.case is not None and is_resume(self.case):
            return test_id(self.scenario.name, self.case.id)
        return reference_name

    def judge(self, reference: RunRecord | None, run: RunRecord) -> Judgement:
        if reference is not None and self.case is not None and is_resume(self.case):
            reference = resume_comparison.continuation_reference(reference)
        return super().judge(reference, run)


def with_resume(scenario: type[Scenario], plan: ResumePlan) -> type[Scenario]:
    """``scenario`` with the resume from its references (``ResumeFromReference``) that ``plan`` describes. A
    comparator the scenario declares keeps judging: the resume's is laid over it, never in its place."""
    own = scenario.comparator_type
    comparator = ResumeComparator if own is None or issubclass(ResumeComparator, own) else \
        type(f"Resume{own.__name__}", (ResumeComparator, own), {})
    return type(scenario.__name__, (ResumeFromReference, scenario), {
        "resume": plan, "comparator_type": comparator, "__doc__": scenario.__doc__, "__module__": scenario.__module__})


class ResumeFromReference(Scenario):
    """The resume from a reference as one wrapper around a training scenario (``with_resume``): ``<case>-resume`` for
    each case ``resume.resumes`` picks, recorded, run, merged and judged here; every other case is the scenario's."""

    resume: ClassVar[ResumePlan]
    comparator_type = ResumeComparator

    def cases(self, setup: Setup) -> list[Case]:
        cases = super().cases(setup)
        if self.resume.last:
            return [*cases, *(self.resume_case(c) for c in cases if self.resume.resumes(c))]
        return [x for c in cases for x in ((c, self.resume_case(c)) if self.resume.resumes(c) else (c,))]

    def resume_case(self, case: Case) -> Case:
        """``<case>-resume`` (``<name>-resume`` for the case named as the scenario): ``case``'s reference continued
        from its checkpoint, on its launch."""
        return replace(case, id="resume" if case.id == self.name else f"{case.id}-resume",
                       data={**case.data, "part": PART}, exercises=None if case.exercises is None else resumed(case.exercises))

    def reference_name(self, case: Case) -> str | None:
        # A resume case judges its case's reference, and records it.
        if is_resume(case):
            case = replace(case, id=self.name if case.id == "resume" else case.id.removesuffix("-resume"))
        return super().reference_name(case)

    def attachments(self, case: Case, record: RunRecord, run: Runner, setup: Setup) -> dict[str, Path]:
        """Recording ``record``, the reference of ``case``: the checkpoint its resume case continues from, saved after
        S steps of a run of its own. {} where it has none, another case of this reference saved it, or it is off."""
        resume = resume_of(self, case, setup)
        if resume is None or ATTACHMENT in record.attachments or record.results.get(resume_comparison.SAVED_KEY):
            return {}
        label = test_id(self.name, resume.id)
        off = self.resume.off_here(setup)
        if launched_by_torchrun():  # each rank is a session of its own there, with a folder of its own to save into
            off = "under torchrun every rank's session would name its own folder; record it spawned locally"
        if off:
            record.notes.append(f"no resume checkpoint recorded: {off}")
            return {}
        # --gpuregress-checkpoint-dir: shared storage where ranks span machines
        root = Path(setup.option("checkpoint-dir") or tempfile.gettempdir()).resolve()
        root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="gpuregress-resume-", dir=root))
        weakref.finalize(record, shutil.rmtree, str(folder), True)  # once the record (and the store's copy) is done
        saved = run(self, Launch(launch_key("save", resume), {**record.config, ROLE: "save", FOLDER: str(folder)},
                                 entry=self.resume.entry))
        result = saved.results.get(RESULT_KEY, {})
        if result.get("unavailable"):
            record.notes.append(f"no resume checkpoint recorded: {result['unavailable']}; {label} will be skipped")
            return {}
        start = resume_step(record.config)
        _note_nondeterminism(record, saved, start, label)
        size = folder_bytes(folder)
        record.results[resume_comparison.SAVED_KEY] = {"step": start, "boundary": result["boundary"], "bytes": size}
        record.notes.append(f"resume checkpoint at step {start}: {human_bytes(size)} in {ATTACHMENT}/")
        self._late_reference(resume, record, folder, run, setup)
        return {ATTACHMENT: folder}

    def _late_reference(self, case: Case, record: RunRecord, folder: Path, run: Runner, setup: Setup) -> None:
        """Into ``record``: the gradients of the checkpoint's step, run from the checkpoint on this stack, and their
        envelope from the noise replicas, each run the same way under its perturbation (late_gradients.py)."""
        config = {**record.config, ROLE: "continue", FOLDER: str(folder), LATE_ONLY: True}
        config.pop("perturbation", None)
        plain = run(self, Launch(launch_key("late", case), config, entry=self.resume.entry))
        late = late_gradients.late_arrays(plain)
        if not late:
            record.notes.append("no late gradients recorded: the run from the resume checkpoint kept none")
            return
        record.arrays.update(late)
        replicas = [run(self, Launch(launch_key(f"late-{r.config['perturbation']}", case), r.config, r.env,
                                     entry=self.resume.entry))
                    for r in self.noise_replicas(Launch("late", config), setup, setup.replicas)]
        if replicas:
            record.arrays[late_gradients.ENVELOPE] = late_gradients.spread(plain, replicas)
        record.notes.append(f"late gradients: step {resume_step(record.config)}'s, from the resume checkpoint, "
                            f"{len(late)} tensors, with the spread of {len(replicas)} noise replicas")

    def experiment(self, case: Case, run: Runner, setup: Setup) -> RunRecord | None:
        """A resume case is skipped, recording or comparing, where its checkpoint is off (GPUs)."""
        off = self.resume.off_here(setup) if is_resume(case) else None
        if off:
            raise NotApplicable(off)
        return super().experiment(case, run, setup)

    def from_reference(self, case: Case, reference: Callable[[], RunRecord], run: Runner,
                       setup: Setup) -> RunRecord | None:
        """Comparing a resume case: the reference's checkpoint loaded on this stack and trained on to the end, or
        NotApplicable."""
        if not is_resume(case):
            return super().from_reference(case, reference, run, setup)
        [launch] = self.launches([case], setup)
        off = self.resume.off_here(setup)
        if off:
            raise NotApplicable(off)
        stored = reference()
        folder = stored.attachments.get(ATTACHMENT)
        if folder is None or not stored.results.get(resume_comparison.SAVED_KEY):
            raise NotApplicable("the reference has no resume checkpoint: re-record it: pytest --gpuregress "
                                f"--gpuregress-record 'gpuregress::{self.name}*'")
        # Cold: the late window reads it as "in a fresh process".
        config = {**launch.config, ROLE: "continue", FOLDER: str(folder)}
        record = run(self, Launch(launch_key("from-reference", case), config, entry=self.resume.entry, cold=True))
        resumed = record.results.get(RESULT_KEY, {})
        if resumed.get("unavailable"):
            raise NotApplicable(f"the resume case is not available on this stack: {resumed['unavailable']}")
        if "step" in resumed:  # the summary row is the reference's: say which run this one is
            record.notes.append(f"{test_id(self.name, case.id)}: the reference's checkpoint (step {resumed['step']}, "
                                f"written with torch {resumed.get('saved_with_torch')}) loaded on this stack, trained "
                                f"on to step {launch.config['steps']}")
        return record

    def merge(self, records: list[RunRecord]) -> RunRecord:
        """A resume launch's records: the default merge, every rank's generator digests (the other pieces are rank
        0's) and late gradients from every rank's shard."""
        if RESULT_KEY not in records[0].results:
            return super().merge(records)
        merged = Scenario.merge(self, records)
        resume = merged.results[RESULT_KEY]
        if "boundary" in resume:
            resume["boundary"] = merge_boundaries([r.results[RESULT_KEY]["boundary"] for r in records])
        merged.arrays.update(step0.merge_ranks(records, step0.LATE))
        return merged

    def compare(self, reference: RunRecord, record: RunRecord, case: Case, lane: str) -> Comparison:
        if is_resume(case):
            return resume_comparison.compare(reference, record, lane)
        return super().compare(reference, record, case, lane)

    def own_findings(self, case: Case, record: RunRecord, setup: Setup) -> list[Problem]:
        # A continuation is judged against the reference's last steps only. Recording, a resume case holds its
        # case's own run, which is stored as the reference: that run's own checks decide whether it may be.
        return [] if RESULT_KEY in record.results else super().own_findings(case, record, setup)

    def triage_explains(self, case: Case) -> bool:
        return not is_resume(case) and super().triage_explains(case)  # triage reruns step 0, which it never ran
