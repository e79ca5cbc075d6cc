"""Before any rank starts: a stored reference recorded with other run settings than this run's.

Comparing a 300-step run with a 100-step reference can only fail, after training: each selected case's record.json
is read now and compared on the settings an option sets. The usage error offers the options reproducing the
reference's settings first, re-recording into a folder of its own second (overwriting would lose the old stack's
numbers). Every other config difference is reported after the run (reference/store.py: check_compatible).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptReference
from ..reference.record import RECORD_FORMAT, RECORD_JSON, RERECORD, other_format, read_json
from ..scenarios import registry

if TYPE_CHECKING:
    from .session import GpuRegressSession

# config key -> the option that sets it
SETTING_OPTIONS = {"steps": "--gpuregress-steps"}


def differing_settings(session: GpuRegressSession) -> tuple[list[str], list[str]]:
    """(a line per selected reference recorded with other settings, with the options to use; their cases' node ids)."""
    lines: dict[str, str] = {}
    selections: list[str] = []
    for name, path, config in _compared(session):
        if str(path) not in lines and (line := _mismatch(path, config)):
            lines[str(path)] = line
            selections += session.places.tests_reading(name)
    return list(lines.values()), selections


def _compared(session: GpuRegressSession) -> Iterator[tuple[str, Path, dict[str, Any]]]:
    """(reference name, its record.json, the launch's config) of each selected training case this run compares."""
    for scenario, cases in session.selection.selected.items():
        sc = registry()[scenario]
        for case in cases if sc.kind == "training" else []:
            name = sc.reference_name(case)
            launch = session.selection.launch_of(sc, case)
            key = session.platform.key(sc.platform_tag(launch.config))
            if name is not None and not session.places.recording(name, key):
                yield name, session.places.location(name, key).path / RECORD_JSON, launch.config


def _mismatch(path: Path, config: dict[str, Any]) -> str | None:
    """Why the reference whose record.json is ``path`` cannot be compared with a launch of ``config``, and the
    options that reproduce its settings; None where it can."""
    recorded, fmt = _recorded_config(path)
    if fmt:
        return (f"{path} was recorded in format {fmt!r}, and this pytest-gpuregress reads {RECORD_FORMAT!r}: it "
                f"cannot be compared; {RERECORD}")
    differing = [(k, recorded[k], config[k]) for k in SETTING_OPTIONS
                 if k in recorded and k in config and recorded[k] != config[k]]
    if not differing:
        return None
    what = ", ".join(f"{k} {ref!r} (this run {ours!r})" for k, ref, ours in differing)
    options = " ".join(f"{SETTING_OPTIONS[k]}={ref}" for k, ref, _ in differing)
    return f"{path} was recorded with {what}: compare with it by adding {options}"


def _recorded_config(path: Path) -> tuple[dict[str, Any], str | None]:
    """(the recorded config, its format where this version does not read it, else None); ({}, None) where the file
    is missing or damaged: the full read after the run names it."""
    try:
        data = read_json(path)
    except CorruptReference:
        return {}, None
    config = data.get("config")
    return (config if isinstance(config, dict) else {}), other_format(data)


def missing_folder(session: GpuRegressSession) -> str | None:
    """The usage error for an explicit --gpuregress-reference-dir that does not exist while comparing: a comparing
    run never creates it (only recording does), so every case would fail 'no reference' after training."""
    options, places = session.options, session.places
    if options.reference_dir is None or options.record or options.record_missing or places.user_root.exists():
        return None
    return (f"--gpuregress-reference-dir={options.reference_dir}: {places.user_root} does not exist, and a comparing "
            "run only reads references; point it at the folder that holds them, or record them there first: "
            f"pytest --gpuregress --gpuregress-record --gpuregress-reference-dir={options.reference_dir} ...")


def usage_message(session: GpuRegressSession) -> str | None:
    """The usage error for references of other settings, or None when every selected one matches this run's."""
    if session.options.record:  # a recording run compares with none of them
        return None
    lines, selections = differing_settings(session)
    if not lines:
        return None
    places = session.places
    hint = places.record_hint(list(dict.fromkeys(selections)), places.elsewhere_root)
    return ("the references this run would compare with were recorded with other settings, so nothing was trained:\n  "
            + "\n  ".join(lines) + "\nor, second choice, record references for this run's settings in a folder of "
            f"their own: {hint}")
