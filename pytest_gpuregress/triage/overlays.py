"""Overlays: the reference's versions of some packages, put first on the ranks' path, never in the user's environment.

Each version is installed once with ``pip install --no-deps --target`` (wheelhouse first, else pip's index); an
added package is hidden by a ``sitecustomize.py`` that empties its modules and drops its metadata (transformers
checks both). Ranks get ``PYTHONPATH`` = hiding folder, versions, the user's own; pooled ranks are reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from ..errors import GpuRegressError
from ..stack.fingerprint import canonical

PIP_TIMEOUT_S = 600.0

# The sitecustomize of a hiding folder: the distributions and top-level modules it hides are in hidden.json beside
# it. It chains to the next sitecustomize on the path, so one of the user's still runs.
HIDER = '''"""Written by pytest-gpuregress's bisect: hides packages installed since a reference was recorded."""
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_HERE, "hidden.json")) as _fh:
    _HIDDEN = json.load(_fh)
_DISTRIBUTIONS = set(_HIDDEN["distributions"])
_MODULES = set(_HIDDEN["modules"])


class _Hide(importlib.abc.MetaPathFinder):
    """A hidden top-level module is found as an empty namespace package, as a stray folder on the path would be:
    nothing can be imported from it, it has no file and no version, and libraries that probe for an optional
    package (transformers' is_*_available) read that as not installed, where an import error would crash them."""

    def find_spec(self, name, path=None, target=None):
        if name in _MODULES:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = []
            return spec
        return None


sys.meta_path.insert(0, _Hide())
_discover = importlib.metadata.Distribution.discover.__func__


def _visible(cls, **kwargs):
    for dist in _discover(cls, **kwargs):
        if re.sub(r"[-_.]+", "-", str(dist.metadata["Name"] or "")).lower() not in _DISTRIBUTIONS:
            yield dist


importlib.metadata.Distribution.discover = classmethod(_visible)
_next = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p) != _HERE])
if _next is not None and _next.loader is not None:
    _module = importlib.util.module_from_spec(_next)
    _next.loader.exec_module(_module)
'''


class BisectProblem(GpuRegressError):
    """An overlay could not be built: a wheel that is nowhere to be had, or pip failing."""


def top_level_modules(package: str) -> list[str]:
    """The importable top-level names an installed distribution provides (its top_level.txt, else its files)."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return [package.replace("-", "_")]
    listed = (dist.read_text("top_level.txt") or "").split()
    if listed:
        return listed
    # Each file's first folder (or module), but its metadata, its data and what it installs outside site-packages.
    names = {entry.parts[0].removesuffix(".py") for entry in dist.files or ()
             if entry.parts and entry.parts[0] != ".." and not entry.parts[0].endswith((".dist-info", ".data"))}
    return sorted(names) or [package.replace("-", "_")]


@dataclass
class Overlays:
    """The overlay folders of one session, under ``root``; versions installed once and reused."""

    root: Path
    wheelhouse: Path | None = None
    installs: dict[tuple[str, str], Path] = field(default_factory=dict)

    def available(self, package: str, version: str) -> str | None:
        """Install ``package==version`` ahead of the experiments; why it cannot be had (a message naming the package,
        the version and the option), or None where it is installed."""
        try:
            self.installed(package, version)
        except BisectProblem as exc:
            return str(exc)
        return None

    def installed(self, package: str, version: str) -> Path:
        """A folder holding ``package==version`` alone (no dependencies), installed on first use."""
        key = (canonical(package), version)
        if key in self.installs:
            return self.installs[key]
        target = self.root / "packages" / f"{key[0]}-{version}"
        if not (target / ".complete").exists():
            self._pip_install(package, version, target)
        self.installs[key] = target
        return target

    def _pip_install(self, package: str, version: str, target: Path) -> None:
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        base = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
                "--quiet", "--target", str(partial), f"{package}=={version}"]
        attempts = []
        if self.wheelhouse is not None:
            attempts.append(("the wheelhouse", [*base, "--no-index", "--find-links", str(self.wheelhouse)]))
        attempts.append(("pip's configured index", base))
        said = []
        for where, command in attempts:
            done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
            if done.returncode == 0:
                (partial / ".complete").write_text(f"{package}=={version} from {where}\n")
                shutil.rmtree(target, ignore_errors=True)
                partial.rename(target)
                return
            last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            said.append(f"{where}: {last}")
            shutil.rmtree(partial, ignore_errors=True)
        option = f"--gpuregress-wheelhouse={self.wheelhouse}" if self.wheelhouse else "--gpuregress-wheelhouse=DIR"
        raise BisectProblem(f"no wheel of {package}=={version} to revert it to ({'; '.join(said)}): put "
                            f"{package.replace('-', '_')}-{version}-*.whl into the folder {option} names")

    def hider(self, packages: Iterable[str]) -> Path | None:
        """A folder whose sitecustomize hides ``packages`` (distributions and their modules); None for none."""
        hidden = sorted({canonical(p) for p in packages})
        if not hidden:
            return None
        folder = self.root / "hide" / "-".join(hidden)
        folder.mkdir(parents=True, exist_ok=True)
        modules = sorted({m for p in hidden for m in top_level_modules(p)})
        (folder / "hidden.json").write_text(json.dumps({"distributions": hidden, "modules": modules}))
        (folder / "sitecustomize.py").write_text(HIDER)
        return folder

    def environment(self, reverted: dict[str, str], hidden: Iterable[str]) -> dict[str, str]:
        """The ranks' extra environment for an experiment: ``reverted`` (package -> the reference's version)
        installed and first on the path, ``hidden`` hidden, the user's own PYTHONPATH after them."""
        folders = [self.hider(hidden), *(self.installed(p, v) for p, v in sorted(reverted.items())),
                   os.environ.get("PYTHONPATH")]
        return {"PYTHONPATH": os.pathsep.join(str(f) for f in folders if f)}
