"""The reference store: ``<root>/<scenario>/<platform-key>/`` holds record.json, tensors.safetensors and a sha256
manifest.json (attachments' files included). Writes are staged and swapped in whole under a lock on the scenario
folder, replace only on ``--gpuregress-record``, and first restore or clean what a crash left; reads ignore
leftovers. docs/architecture.md, "The reference store".
"""

from __future__ import annotations

import datetime as _dt
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptReference, ForeignReference, MissingReference, ReferenceExists
from . import atomic
from .names import safe_component
from .record import RECORD_JSON, TENSORS_FILE, RunRecord, read_json

MANIFEST = "manifest.json"
STORE_FORMAT = "gpuregress-reference/1"


@dataclass(frozen=True)
class ReferenceLocation:
    """Where a reference for (scenario, platform) lives, and the command that records it."""

    root: Path
    scenario: str
    platform_key: str
    record_hint: str = "pytest --gpuregress --gpuregress-record"
    # How to record this stack's reference elsewhere, keeping this one (which the old stack still needs).
    record_elsewhere_hint: str = ""

    @property
    def path(self) -> Path:
        return self.root / self.scenario / self.platform_key


def check_names(scenario: str, platform_key: str) -> None:
    """Refuse a reference name or platform key that would leave the reference root or hide in it."""
    safe_component(scenario, "reference name (the name= given to gpuregress.check(), else the scenario's name)")
    safe_component(platform_key, "platform key (device, backend, world size and the scenario's platform tag, "
                                 "e.g. its dtype)")


def write_reference(loc: ReferenceLocation, record: RunRecord, *, overwrite: bool) -> Path:
    """Atomically store ``record``; refuse to replace an existing reference unless ``overwrite``."""
    check_names(loc.scenario, loc.platform_key)
    target = loc.path
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic.locked(target.parent):  # a live writer's staging folder is not a leftover
        _restore_moved_aside(loc)  # before the overwrite check: a moved-aside reference still counts
        if (target / MANIFEST).exists() and not overwrite:
            raise ReferenceExists(target, "a reference is already stored here",
                                  "pass --gpuregress-record to replace it on purpose")
        atomic.remove_leftovers(target)
        _write_staged(target, record)
    return target


def _write_staged(target: Path, record: RunRecord) -> None:
    staged = atomic.staging_dir_for(target)
    try:
        files = record.save(staged) + _copy_attachments(record, staged)
        manifest = {
            "format": STORE_FORMAT,
            "scenario": record.scenario,
            "platform_key": record.platform_key,
            "recorded_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "files": {f.relative_to(staged).as_posix(): atomic.sha256_file(f) for f in files},
        }
        atomic.write_json(staged / MANIFEST, manifest)
        atomic.replace_dir(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def _copy_attachments(record: RunRecord, staged: Path) -> list[Path]:
    """Copy each of ``record``'s attachment folders into the staged reference; return the files copied."""
    copied: list[Path] = []
    for name, folder in sorted(record.attachments.items()):
        safe_component(name, "attachment name (a folder inside the reference)")
        if name in (RECORD_JSON, TENSORS_FILE, MANIFEST):
            raise ValueError(f"attachment {name!r} would replace the reference's own {name}")
        shutil.copytree(folder, staged / name)
        copied += sorted(p for p in (staged / name).rglob("*") if p.is_file())
    return copied


def _attachment_of(listed: str) -> str | None:
    """The attachment folder of a manifest entry (``resume`` for ``resume/trainer.json``); None outside one."""
    parts = listed.split("/")
    if len(parts) < 2 or any(part in ("", ".", "..") for part in parts) or "\\" in listed:
        return None
    return parts[0] if parts[0] not in (RECORD_JSON, TENSORS_FILE, MANIFEST) else None


def _restore_moved_aside(loc: ReferenceLocation) -> None:
    """Put back the reference a crash between two renames left at ``.<key>.old-*``; say so."""
    target = loc.path
    try:
        restored_from = atomic.restore_orphan(target)
    except OSError as exc:
        raise MissingReference(target, f"an interrupted recording moved this reference aside and it could not be put "
                               f"back ({exc})", f"rename the newest {target.parent / ('.' + target.name + atomic.OLD)}* "
                               f"folder to {target.name}") from exc
    if restored_from is not None:
        warnings.warn(f"gpuregress: {target}: put back the reference an interrupted recording had moved aside "
                      f"to {restored_from.name}", RuntimeWarning, stacklevel=3)


def read_reference(loc: ReferenceLocation) -> RunRecord:
    """Load and verify a reference; MissingReference or CorruptReference name the file. Names are not checked:
    ``gpuregress show DIR`` reads any folder (the plugin checks them, check_names)."""
    target = loc.path
    if not target.exists() and target.parent.is_dir():
        with atomic.locked(target.parent):  # waits out a live writer between its two renames
            _restore_moved_aside(loc)
    manifest_path = target / MANIFEST
    if not manifest_path.exists():
        what = "no reference recorded" if not target.exists() else "directory has no manifest.json"
        raise MissingReference(target, f"{what} for scenario {loc.scenario!r} on platform {loc.platform_key!r}"
                               f"{_beside(loc)}", f"record one on a known-good stack: {loc.record_hint}")
    folders = _verified_files(loc, manifest_path)
    record = RunRecord.load(target)
    record.attachments = {folder: target / folder for folder in folders}
    return record


def _verified_files(loc: ReferenceLocation, manifest_path: Path) -> list[str]:
    """Check every listed file's sha256, and that the kept folders hold nothing else; return those folders.
    Raises CorruptReference naming the file."""
    files = _listed_files(loc, manifest_path)
    for name, expected in files.items():
        _check_sha256(loc, loc.path / name, expected)
    folders = sorted(set(map(_attachment_of, files)) - {None})
    for folder in folders:  # a file slipped into a kept folder would be read with it: DCP reads every shard there
        unlisted = [p for p in sorted((loc.path / folder).rglob("*"))
                    if p.relative_to(loc.path).as_posix() not in files and (p.is_file() or p.is_symlink())]
        if unlisted:
            raise CorruptReference(unlisted[0], "file not listed in manifest.json: the folder holds more than was "
                                   "recorded", f"remove it, restore the folder from version control, or re-record "
                                   f"it: {loc.record_hint}")
    return folders


def _check_sha256(loc: ReferenceLocation, path: Path, expected: Any) -> None:
    if not path.is_file():
        raise CorruptReference(path, "file listed in manifest.json is missing", f"re-record it: {loc.record_hint}")
    actual = atomic.sha256_file(path)
    if actual != expected:
        raise CorruptReference(path, f"sha256 {actual[:12]}… does not match manifest.json ({str(expected)[:12]}…): "
                               "the file was truncated, edited or partly copied",
                               f"restore it from version control, or re-record it: {loc.record_hint}")


def _listed_files(loc: ReferenceLocation, manifest_path: Path) -> dict[str, Any]:
    """The manifest's files and sha256s: the record's two, others only inside attachments; else CorruptReference."""
    manifest = read_json(manifest_path)
    if manifest.get("format") != STORE_FORMAT:
        raise CorruptReference(manifest_path, f"not a pytest-gpuregress reference manifest (format "
                               f"{manifest.get('format')!r})", f"remove the directory or re-record it: {loc.record_hint}")
    files = manifest.get("files")
    own = {RECORD_JSON, TENSORS_FILE}
    if not isinstance(files, dict) or not own <= set(files) or any(_attachment_of(n) is None for n in set(files) - own):
        raise CorruptReference(manifest_path, "manifest lists the wrong files", f"re-record it: {loc.record_hint}")
    return files


def _beside(loc: ReferenceLocation) -> str:
    """Name the scenario's references of another world size or precision, with the option selecting a world size:
    a run with too few devices must not read as 'never recorded'."""
    folder = loc.path.parent
    others = sorted(p.name for p in folder.iterdir() if p.name != loc.platform_key and (p / MANIFEST).exists()
                    and _differs_in_size_or_precision(p.name, loc.platform_key)) if folder.is_dir() else []
    if not others:
        return ""
    sizes = sorted({m.group(1) for name in others if (m := re.search(r"-w(\d+)-", name))})
    option = f" (--gpuregress-world-size={' or '.join(sizes)} compares with it)" if sizes else ""
    return f"; the same folder holds {', '.join(others)}{option}"


def _differs_in_size_or_precision(key: str, other: str) -> bool:
    """cpu-gloo-w2-fp32-fsdp2 against cpu-gloo-w1-fp32-fsdp2: the same platform but its world size or dtype."""
    ours, theirs = key.split("-"), other.split("-")
    varying = re.compile(r"w\d+|fp32|bf16|fp16|fp8")
    return len(ours) == len(theirs) and all(a == b or (varying.fullmatch(a) and varying.fullmatch(b))
                                            for a, b in zip(ours, theirs))


def load_record(path: Path) -> RunRecord:
    """A reference folder (verified against its manifest) or a bare record folder: what the CLI reads."""
    if (path / MANIFEST).exists():
        return read_reference(ReferenceLocation(path.parent.parent, path.parent.name, path.name))
    return RunRecord.load(path)


def check_compatible(loc: ReferenceLocation, reference: RunRecord, run: RunRecord) -> None:
    """Refuse to compare against a reference of another scenario, config or world size."""
    problems: list[str] = []
    if reference.scenario != run.scenario:
        problems.append(f"scenario: reference {reference.scenario!r}, this run {run.scenario!r}")
    if reference.world_size != run.world_size:
        problems.append(f"world size: reference {reference.world_size}, this run {run.world_size}")
    problems.extend(config_differences(reference.config, run.config))
    if problems:
        raise ForeignReference(loc.path / RECORD_JSON,
                               "reference was recorded for a different setup:\n    " + "\n    ".join(problems),
                               "run with the reference's settings, or record a reference for this setup: " + loc.record_hint)


# Where an input lives on this machine, not what it is (its sha256 beside it says that): never foreign.
LOCATION_KEYS = frozenset({"tokens.file", "tokens.factory", "model_file", "model_factory"})


def config_differences(ref: dict[str, Any], run: dict[str, Any], labels: tuple[str, str] = ("reference", "this run"),
                       prefix: str = "") -> list[str]:
    """What two configs disagree on, as "config <key>: reference <a>, this run <b>" lines (not LOCATION_KEYS)."""
    out: list[str] = []
    for key in sorted(set(ref) | set(run)):
        if f"{prefix}{key}" in LOCATION_KEYS:
            continue
        a, b = ref.get(key, "<absent>"), run.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_differences(a, b, labels, f"{prefix}{key}."))
        elif a != b:
            out.append(f"config {prefix}{key}: {labels[0]} {a!r}, {labels[1]} {b!r}")
    return out
