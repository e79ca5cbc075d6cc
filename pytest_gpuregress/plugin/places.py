"""Where references live: the user's folder first, the shipped ones as the default's fallback; whether this run
writes a reference; and which references on disk no case of this configuration reads."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ..option_spec import OptionSpec
from ..reference import store
from ..resources import shipped_dir
from ..scenarios import registry
from .collection import ROOT
from .options import FIELDS, Options
from .selection import Selection


class ReferencePlaces:
    def __init__(self, options: Options, rootpath: Path, selection: Selection) -> None:
        self.options = options
        self.rootpath = rootpath
        self.selection = selection
        self.used: set[str] = set()  # every reference this session looked for: a user's own loop names its own
        self.current_test: str | None = None  # the running test's node id, as typed where pytest runs
        self.readers: dict[str, list[str]] = {}  # reference -> the tests that looked for it, beside the built-in cases

    @property
    def user_root(self) -> Path:
        return self.options.reference_dir or (self.rootpath / "reference_runs")

    @property
    def shipped_root(self) -> Path:
        return shipped_dir("reference_runs")

    @property
    def recording_root(self) -> Path:
        """Where a printed record command writes: the user's folder, never the references shipped with the plugin
        (the user's folder is the shipped one only inside the plugin's own checkout, or when named so)."""
        root = self.user_root
        return root.with_name(f"{root.name}-recorded") if root.resolve() == self.shipped_root.resolve() else root

    @property
    def elsewhere_root(self) -> Path:
        """A folder of its own for this stack's references, beside the one read (which the old stack keeps)."""
        root = self.recording_root
        return root.with_name(f"{root.name}-this-stack")

    def record_hint(self, tests: list[str], folder: Path | None = None) -> str:
        """The command that records the references ``tests`` (node ids) read, with this run's setup, into ``folder``
        (default: the user's folder)."""
        options = self.options
        core = [(FIELDS[name].spec, getattr(options, name)) for name in ("steps", "world_size", "device")]
        specs = {spec.dest: spec for sc in registry().values() for spec in sc.options}
        parts = ["pytest", "--gpuregress", "--gpuregress-record", *tests,
                 f"--gpuregress-reference-dir={folder or self.recording_root}", *_changed(core),
                 # The models and data shape the config too (a model's cases exist only with its option).
                 *(f"--gpuregress-model={m.name if m.shipped else m.source}" for m in options.models),
                 *_changed([(FIELDS["tokens"].spec, options.tokens)]),
                 # A scenario's own options can shape its config: the hinted command must record the same setup.
                 *_changed([(specs[dest], value) for dest, value in sorted(options.scenario_values.items())
                            if dest in specs])]
        return shlex.join(parts)

    def location(self, name: str, platform_key: str, *, for_writing: bool = False) -> store.ReferenceLocation:
        store.check_names(name, platform_key)  # a name or dtype such as '../x' must not leave the reference dir
        self.used.add(name)
        tests = self.tests_reading(name)
        hint, elsewhere = self.record_hint(tests), self.record_hint(tests, self.elsewhere_root)
        user = store.ReferenceLocation(self.user_root, name, platform_key, hint, elsewhere)
        # An explicit --gpuregress-reference-dir means that directory only; the shipped
        # references are the fallback of the default location.
        if for_writing or self.options.reference_dir is not None or (user.path / store.MANIFEST).exists():
            return user
        shipped = store.ReferenceLocation(self.shipped_root, name, platform_key, hint, elsewhere)
        return shipped if (shipped.path / store.MANIFEST).exists() else user

    def tests_reading(self, name: str) -> list[str]:
        """The node ids that select the tests reading ``name``: the built-in cases that do, and the project's tests
        that looked for it in this session (noted here, while they run)."""
        test = self.current_test
        if test is not None and not test.startswith(f"{ROOT}::") and test not in self.readers.setdefault(name, []):
            self.readers[name].append(test)
        return list(dict.fromkeys([*self.selection.node_ids_for(name), *self.readers.get(name, [])]))

    def recording(self, name: str, platform_key: str) -> bool:
        """Whether this run writes the reference ``name``: --gpuregress-record, or --gpuregress-record-missing and
        no reference exists where this run would read it."""
        if self.options.record or not self.options.record_missing:
            return self.options.record
        return not (self.location(name, platform_key).path / store.MANIFEST).exists()

    def unused(self, platform_keys: set[str]) -> list[str]:
        """References in the user's folder, for this run's platforms, that no case of this configuration reads
        (as syrupy lists unused snapshots): left over from a removed model or case, or read only with an option
        this run did not give."""
        if not self.user_root.is_dir() or self.user_root.resolve() == self.shipped_root.resolve():
            return []  # the plugin's own shipped references (this repository's main job) are not the user's to prune
        wanted = self.selection.reference_names() | self.used  # the cases' references, and any this run read
        return sorted(f"{manifest.parent.parent.name}/{manifest.parent.name}"
                      for manifest in self.user_root.glob(f"*/*/{store.MANIFEST}")
                      if manifest.parent.name in platform_keys and manifest.parent.parent.name not in wanted)


def _changed(given: list[tuple[OptionSpec, Any]]) -> list[str]:
    """``--flag=value`` for each option given a value other than its default (a list's values joined by commas)."""
    return [f"{spec.flag}={','.join(value) if isinstance(value, list) else value}"
            for spec, value in given if value != spec.default]
