"""Before any rank starts: a stored reference recorded with other run settings than this run's.

Comparing a 300-step run with a reference of 100 steps can only fail, and only after training. So after
collection, each selected case's reference config is read (record.json only, no tensors) and compared with the
launch's on the settings an option sets. A mismatch stops the session as a usage error that prints the options
reproducing the reference's settings first, and re-recording into a folder of its own only second: overwriting
the reference would lose what the old stack computed. Every other config difference is still reported after the
run (reference/store.py: check_compatible), where a damaged record.json is reported too.
"""

from __future__ import annotations

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
    """(one line per selected reference whose recorded settings differ from this run's, with the options to use;
    the node ids of those references' cases)."""
    lines: dict[str, str] = {}
    selections: list[str] = []
    for scenario, cases in session.selection.selected.items():
        sc = registry()[scenario]
        for case in cases if sc.kind == "training" else []:
            name = sc.reference_name(case)
            launch = session.selection.launch_of(sc, case)
            key = session.platform.key(sc.platform_tag(launch.config))
            if name is None or session.places.recording(name, key):
                continue
            path = session.places.location(name, key).path / RECORD_JSON
            recorded, fmt = _recorded_config(path)
            differing = [(k, recorded[k], launch.config[k]) for k in SETTING_OPTIONS
                         if k in recorded and k in launch.config and recorded[k] != launch.config[k]]
            if (differing or fmt) and str(path) not in lines:
                if fmt:
                    lines[str(path)] = (f"{path} was recorded in format {fmt!r}, and this pytest-gpuregress reads "
                                        f"{RECORD_FORMAT!r}: it cannot be compared; {RERECORD}")
                else:
                    what = ", ".join(f"{k} {ref!r} (this run {ours!r})" for k, ref, ours in differing)
                    options = " ".join(f"{SETTING_OPTIONS[k]}={ref}" for k, ref, _ in differing)
                    lines[str(path)] = f"{path} was recorded with {what}: compare with it by adding {options}"
                selections += session.places.tests_reading(name)
    return list(lines.values()), selections


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
    lines, selections = differing_settings(session)
    if not lines:
        return None
    places = session.places
    hint = places.record_hint(list(dict.fromkeys(selections)), places.elsewhere_root)
    return ("the references this run would compare with were recorded with other settings, so nothing was trained:\n  "
            + "\n  ".join(lines) + "\nor, second choice, record references for this run's settings in a folder of "
            f"their own: {hint}")
