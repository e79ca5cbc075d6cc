"""Session side of a resume from a reference's own checkpoint (fsdp-resume, lora's resume cases): what a
recording stores beside the reference, the launch that continues from it, and the comparator that judges a
continuation against the reference's last steps.

Recording a reference that has a resume case (on the CPU always; on GPUs with --gpuregress-resume-checkpoint)
also runs a ``resume-save`` launch: the run's first S = steps // 2 steps again, then the whole training
state saved (resume_roles.py). Its folder goes into the reference as ``resume/`` (RunRecord.attachments:
every file in the manifest), the digests of the state it saved into the reference's results. The main
launch is not touched, so the reference's numbers are those of a run without it.

Comparing, the resume case runs a ``resume-from-reference`` launch: this stack loads the reference's
checkpoint (written by the recording stack) and trains on to the end; resume_comparison.py judges the load
piece by piece and the continuation within the reference's envelope. A scenario holds one ``ResumePlan``
(its rank entry and what its checkpoint weighs on GPUs) and names its resume cases. torch-free.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import NotApplicable
from ...reference import step0
from ...reference.judgement import Judgement
from ...reference.record import RunRecord
from ...stack.platforms import launched_by_torchrun
from ...units import human_bytes
from ..base import Case, Launch, Runner, Scenario, Setup
from ..comparator import Comparator
from . import late_gradients, resume_comparison
from .late_gradients import LATE_ONLY
from .resume_roles import FOLDER, RESULT_KEY, ROLE, resume_step
from .state_pieces import merge_boundaries

PART = "resume"  # a resume case's data["part"]
ATTACHMENT = "resume"  # the folder inside the reference


def is_resume(case: Case) -> bool:
    return case.data.get("part") == PART


def late_window_case(sc: Scenario, case: Case, setup: Setup) -> Case | None:
    """The resume case that continues ``case``'s reference from its late checkpoint (same launch, same
    reference), which judges a divergence of ``case`` that starts after step 0; None where it has none."""
    if is_resume(case):
        return None
    return next((c for c in sc.cases(setup) if is_resume(c) and c.launch == case.launch
                 and sc.reference_name(c) == sc.reference_name(case)), None)


def case_label(sc: Scenario, case: Case) -> str:
    """The resume case's test id, as notes name it: fsdp-resume, lora-fully_shard-resume."""
    return f"{sc.name}-{case.id}"


def launch_key(role: str, case: Case) -> str:
    """``resume-<role>``, then the case's launch where a scenario has several (lora: one per wrapper)."""
    return f"resume-{role}" if case.launch == "default" else f"resume-{role}-{case.launch}"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _root(setup: Setup) -> Path:
    """Where the resume-save launch writes (shared storage when ranks span machines): --gpuregress-checkpoint-dir."""
    return Path(setup.option("checkpoint-dir") or tempfile.gettempdir()).resolve()


def merge_resume(merged: RunRecord, records: list[RunRecord]) -> RunRecord:
    """Every rank's generator digests of a resume launch into ``merged`` (the other pieces are rank 0's), and its
    late gradients from every rank's shard."""
    resume = merged.results.get(RESULT_KEY)
    if resume and "boundary" in resume:
        resume["boundary"] = merge_boundaries([r.results[RESULT_KEY]["boundary"] for r in records])
    merged.arrays.update(step0.merge_ranks(records, step0.LATE))
    return merged


@dataclass(frozen=True)
class ResumePlan:
    """A scenario's resume from its reference: the rank entry of its two launches (resume_roles.Roles), and what
    the checkpoint holds on GPUs, said in the skip where it is off."""

    entry: str
    gpu_size: str  # e.g. "weights and AdamW's two moments, 12 bytes per parameter: about 1.9 GB for ..."

    def off_here(self, setup: Setup) -> str | None:
        """Why the resume checkpoint is neither recorded nor resumed on this device; None where it is."""
        if setup.device_kind != "cuda" or setup.option("resume-checkpoint"):
            return None
        return (f"on GPUs the resume checkpoint is optional for its size ({self.gpu_size}): record and compare it "
                "with --gpuregress-resume-checkpoint")

    def attachments(self, sc: Scenario, case: Case, record: RunRecord, run: Runner, setup: Setup) -> dict[str, Path]:
        """Recording ``record``, the reference of the resume case ``case``: the checkpoint, saved after S steps of a
        run of its own. {} where another case of this reference saved it already, or it is off here."""
        if ATTACHMENT in record.attachments or record.results.get(resume_comparison.SAVED_KEY):
            return {}
        label = case_label(sc, case)
        off = self.off_here(setup)
        if launched_by_torchrun():  # each rank is a session of its own there, with a folder of its own to save into
            off = "under torchrun every rank's session would name its own folder; record it spawned locally"
        if off:
            record.notes.append(f"no resume checkpoint recorded: {off}")
            return {}
        root = _root(setup)
        root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="gpuregress-resume-", dir=root))
        weakref.finalize(record, shutil.rmtree, str(folder), True)  # once the record (and the store's copy) is done
        saved = run(sc, Launch(launch_key("save", case), {**record.config, ROLE: "save", FOLDER: str(folder)},
                               entry=self.entry))
        result = saved.results.get(RESULT_KEY, {})
        if result.get("unavailable"):
            record.notes.append(f"no resume checkpoint recorded: {result['unavailable']}; {label} will be skipped")
            return {}
        start = resume_step(record.config)
        first, again = record.series.get("loss", [])[:start], saved.series.get("loss", [])
        if [float(x).hex() for x in first] != [float(x).hex() for x in again]:
            step = next((i for i, (a, b) in enumerate(zip(first, again)) if float(a).hex() != float(b).hex()),
                        len(again))
            record.notes.append(f"resume checkpoint: its run's first {start} steps are not bitwise this run's (from "
                                f"step {step}): this stack is not deterministic, so the checkpoint is a neighbour of "
                                f"the reference's state, and {label} judges from it within tolerances")
        size = folder_bytes(folder)
        record.results[resume_comparison.SAVED_KEY] = {"step": start, "boundary": result["boundary"], "bytes": size}
        record.notes.append(f"resume checkpoint at step {start}: {human_bytes(size)} in {ATTACHMENT}/")
        self._late_reference(sc, case, record, folder, run, setup)
        return {ATTACHMENT: folder}

    def _late_reference(self, sc: Scenario, case: Case, record: RunRecord, folder: Path, run: Runner,
                        setup: Setup) -> None:
        """Into ``record``: the gradients of the checkpoint's step, run from the checkpoint on this stack, and their
        envelope from the noise replicas, each run the same way under its perturbation (late_gradients.py)."""
        config = {**record.config, ROLE: "continue", FOLDER: str(folder), LATE_ONLY: True}
        config.pop("perturbation", None)
        plain = run(sc, Launch(launch_key("late", case), config, entry=self.entry))
        late = late_gradients.late_arrays(plain)
        if not late:
            record.notes.append("no late gradients recorded: the run from the resume checkpoint kept none")
            return
        record.arrays.update(late)
        replicas = [run(sc, Launch(launch_key(f"late-{r.config['perturbation']}", case), r.config, r.env,
                                   entry=self.entry))
                    for r in sc.noise_replicas(Launch("late", config), setup, setup.replicas)]
        if replicas:
            record.arrays[late_gradients.ENVELOPE] = late_gradients.spread(plain, replicas)
        record.notes.append(f"late gradients: step {resume_step(record.config)}'s, from the resume checkpoint, "
                            f"{len(late)} tensors, with the spread of {len(replicas)} noise replicas")

    def continue_from(self, sc: Scenario, case: Case, config: dict[str, Any], reference: Callable[[], RunRecord],
                      run: Runner, setup: Setup) -> RunRecord:
        """Comparing the resume case ``case`` (its launch's ``config``): load the reference's checkpoint on this
        stack and train on to the end, or NotApplicable."""
        off = self.off_here(setup)
        if off:
            raise NotApplicable(off)
        stored = reference()
        folder = stored.attachments.get(ATTACHMENT)
        if folder is None or not stored.results.get(resume_comparison.SAVED_KEY):
            raise NotApplicable("the reference has no resume checkpoint: re-record it: pytest --gpuregress "
                                f"--gpuregress-record 'gpuregress::{sc.name}*'")
        # Cold: the late window reads it as "in a fresh process".
        record = run(sc, Launch(launch_key("from-reference", case),
                                {**config, ROLE: "continue", FOLDER: str(folder)}, entry=self.entry, cold=True))
        resumed = record.results.get(RESULT_KEY, {})
        if resumed.get("unavailable"):
            raise NotApplicable(f"the resume case is not available on this stack: {resumed['unavailable']}")
        if "step" in resumed:  # the summary row is the reference's: say which run this one is
            record.notes.append(f"{case_label(sc, case)}: the reference's checkpoint (step {resumed['step']}, written "
                                f"with torch {resumed.get('saved_with_torch')}) loaded on this stack, trained on to "
                                f"step {config['steps']}")
        return record


class ResumeComparator(Comparator):
    """The default judgement, but a resume case's continuation is judged (and plotted, and kept) against the
    reference's steps from its checkpoint on."""

    def row_label(self, reference_name: str) -> str:
        # A continuation shares its reference's folder: the row says it is the resume (fsdp-resume).
        if self.scenario is not None and self.case is not None and is_resume(self.case):
            return case_label(self.scenario, self.case)
        return reference_name

    def judge(self, reference: RunRecord | None, run: RunRecord) -> Judgement:
        if reference is not None and self.case is not None and is_resume(self.case):
            reference = resume_comparison.continuation_reference(reference)
        return super().judge(reference, run)
