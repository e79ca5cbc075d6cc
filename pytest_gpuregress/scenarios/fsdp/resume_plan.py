"""Session side of the fsdp scenario's resume from its reference: the case, its launches, what a recording
stores beside the reference, and the comparator that judges a continuation against the reference's last steps.

Recording the fsdp reference (on the CPU always; on GPUs with --gpuregress-resume-checkpoint) also runs
the ``resume-save`` launch: the run's first S = steps // 2 steps again, then the whole training state
saved. Its folder goes into the reference as ``resume/`` (RunRecord.attachments: every file in the
manifest), the digests of the state it saved into the reference's results. The main launch is not
touched, so the reference's numbers are those of a run without it.

Comparing, the case ``fsdp-resume`` runs the ``resume-from-reference`` launch: this stack loads the
reference's checkpoint (written by the recording stack) and trains on to the end; resume_verdict.py
judges the load piece by piece and the continuation within the reference's envelope. torch-free.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

from ...errors import NotApplicable
from ...reference.judgement import Judgement
from ...reference.record import RunRecord
from ...stack.platforms import launched_by_torchrun
from ...units import human_bytes
from ..base import Case, Launch, Scenario, Setup
from ..comparator import Comparator
from . import resume_verdict
from .resume import ENTRY, FOLDER, RESULT_KEY, ROLE, resume_step

Runner = Callable[[Scenario, Launch], RunRecord]

PART = "resume"
CASE = Case("resume", data={"part": PART})  # launch "default": recording it records the fsdp reference itself
ATTACHMENT = "resume"  # the folder inside the reference
GPU_BYTES_PER_PARAMETER = 12  # fp32 weights, exp_avg and exp_avg_sq (FSDP2 keeps fp32 shards under bf16 compute)
GPU_MODEL_PARAMETERS = 155_730_944  # the tiny Llama at GPU size (models/tiny-llama/gpu)
RERECORD = "re-record it: pytest --gpuregress --gpuregress-record -k fsdp"


def is_resume(case: Case) -> bool:
    return case.data.get("part") == PART


def off_here(setup: Setup) -> str | None:
    """Why the resume checkpoint is neither recorded nor resumed on this device; None where it is."""
    if setup.device_kind != "cuda" or setup.option("resume-checkpoint"):
        return None
    size = GPU_BYTES_PER_PARAMETER * GPU_MODEL_PARAMETERS / 1e9
    return ("on GPUs the resume checkpoint is optional for its size (weights and AdamW's two moments, 12 bytes per "
            f"parameter: about {size:.1f} GB for the 156 M-parameter model): record and compare it with "
            "--gpuregress-resume-checkpoint")


def _root(setup: Setup) -> Path:
    """Where the resume-save launch writes (shared storage when ranks span machines): --gpuregress-checkpoint-dir."""
    return Path(setup.option("checkpoint-dir") or tempfile.gettempdir()).resolve()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def attachments(sc: Scenario, case: Case, record: RunRecord, run: Runner, setup: Setup) -> dict[str, Path]:
    """Recording the tiny Llama's reference: the resume checkpoint, saved after S steps of a run of its own."""
    if case.launch != "default" or ATTACHMENT in record.attachments or record.results.get(resume_verdict.SAVED_KEY):
        return {}  # a user's model (not yet), or the other case of this reference recorded it already
    off = off_here(setup)
    if launched_by_torchrun():  # each rank is a session of its own there, with a folder of its own to save into
        off = "under torchrun every rank's session would name its own folder; record it spawned locally"
    if off:
        record.notes.append(f"no resume checkpoint recorded: {off}")
        return {}
    root = _root(setup)
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="gpuregress-resume-", dir=root))
    weakref.finalize(record, shutil.rmtree, str(folder), True)  # once the record (and the store's copy) is done
    saved = run(sc, Launch("resume-save", {**record.config, ROLE: "save", FOLDER: str(folder)}, entry=ENTRY))
    result = saved.results.get(RESULT_KEY, {})
    if result.get("unavailable"):
        record.notes.append(f"no resume checkpoint recorded: {result['unavailable']}; fsdp-resume will be skipped")
        return {}
    start = resume_step(record.config)
    first, again = record.series.get("loss", [])[:start], saved.series.get("loss", [])
    if [float(x).hex() for x in first] != [float(x).hex() for x in again]:
        step = next((i for i, (a, b) in enumerate(zip(first, again)) if float(a).hex() != float(b).hex()), len(again))
        record.notes.append(f"resume checkpoint: its run's first {start} steps are not bitwise this run's (from step "
                            f"{step}): this stack is not deterministic, so the checkpoint is a neighbour of the "
                            "reference's state, and fsdp-resume judges from it within tolerances")
    size = folder_bytes(folder)
    record.results[resume_verdict.SAVED_KEY] = {"step": start, "boundary": result["boundary"], "bytes": size}
    record.notes.append(f"resume checkpoint at step {start}: {human_bytes(size)} in {ATTACHMENT}/")
    return {ATTACHMENT: folder}


def continue_from(sc: Scenario, reference: Callable[[], RunRecord], run: Runner, setup: Setup) -> RunRecord:
    """Comparing: load the reference's checkpoint on this stack and train on to the end, or NotApplicable."""
    off = off_here(setup)
    if off:
        raise NotApplicable(off)
    stored = reference()
    folder = stored.attachments.get(ATTACHMENT)
    if folder is None or not stored.results.get(resume_verdict.SAVED_KEY):
        raise NotApplicable(f"the reference has no resume checkpoint: {RERECORD}")
    config = sc.default_config(setup)
    record = run(sc, Launch("resume-from-reference", {**config, ROLE: "continue", FOLDER: str(folder)}, entry=ENTRY))
    unavailable = record.results.get(RESULT_KEY, {}).get("unavailable")
    if unavailable:
        raise NotApplicable(f"the resume case is not available on this stack: {unavailable}")
    resumed = record.results.get(RESULT_KEY, {})
    if "step" in resumed:  # the summary row is the fsdp reference's: say which run this one is
        record.notes.append(f"fsdp-resume: the reference's checkpoint (step {resumed['step']}, written with torch "
                            f"{resumed.get('saved_with_torch')}) loaded on this stack, trained on to step {config['steps']}")
    return record


class FsdpComparator(Comparator):
    """The default judgement, but a continuation is judged (and plotted, and kept) against the reference's steps
    from its checkpoint on."""

    def judge(self, reference: RunRecord | None, run: RunRecord) -> Judgement:
        if reference is not None and self.case is not None and is_resume(self.case):
            reference = resume_verdict.continuation_reference(reference)
        return super().judge(reference, run)

