"""What ``pytest --gpuregress`` collects: the project's own tests as pytest always does, and the built-in suite.

The built-in cases join when no test path is given, unless ``--gpuregress-no-builtin``; ``gpuregress`` or
``gpuregress::<case>`` (``*`` allowed) among the paths names them, and is taken off pytest's arguments here.
Node ids are printed as a user types them.
"""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = "gpuregress"  # the built-in suite's node id, and the first part of every built-in case's


def builtin_node_id(case_id: str) -> str:
    """The node id of the built-in case ``case_id`` (a test id such as ``fsdp-bf16``)."""
    return f"{ROOT}::{case_id}"


def typed_node_id(item: pytest.Item) -> str:
    """``item``'s node id with its file relative to the folder pytest runs in (pytest's node ids start at the
    rootdir), so a printed command that names it runs from where the user ran pytest."""
    head, sep, rest = item.nodeid.partition("::")
    if head == ROOT or not sep:
        return item.nodeid
    return os.path.relpath(item.path, item.config.invocation_params.dir).replace(os.sep, "/") + sep + rest


class BuiltinRequest(NamedTuple):
    """Whether the built-in suite is collected, and which of its cases (None: all; else fnmatch patterns)."""

    wanted: bool
    only: frozenset[str] | None = None
    left_out_by: str = ""  # why it is not collected, for the header: a CI job that narrowed its paths must see it


def _names_builtin(arg: str, invocation_dir: Path, rootpath: Path) -> bool:
    """``gpuregress[::case]``, or as pytest shows it from a folder below the rootdir (``../gpuregress::fsdp``);
    a file or folder of that name is the user's."""
    head = invocation_dir / arg.split("::", 1)[0]
    return head.resolve() in (invocation_dir.resolve() / ROOT, rootpath.resolve() / ROOT) and not head.exists()


def take_builtin_arguments(config: pytest.Config, leave_out: bool) -> BuiltinRequest:
    """Read the built-in suite's node ids off ``config.args`` and say what the suite contributes.

    ``leave_out``: --gpuregress-no-builtin (ini gpuregress_no_builtin), for a project that checks its own loops."""
    invocation_dir = config.invocation_params.dir
    named = [a for a in config.args if _names_builtin(a, invocation_dir, config.rootpath)]
    config.args = [a for a in config.args if a not in named]
    if named:
        return _naming(named)
    if config.option.file_or_dir:  # paths the user gave: only those, as pytest always does
        given = " ".join(config.option.file_or_dir)
        return BuiltinRequest(False, left_out_by=f"the paths given ({given}) narrow collection; name {ROOT} among "
                                                 "them to add the built-in cases")
    return BuiltinRequest(not leave_out, left_out_by="--gpuregress-no-builtin" if leave_out else "")


def _naming(named: list[str]) -> BuiltinRequest:
    """The cases ``gpuregress::<case>`` arguments name; all of them where a bare ``gpuregress`` is among them."""
    ids = [a.split("::", 1)[1] for a in named if "::" in a]
    return BuiltinRequest(True, None if len(ids) < len(named) else frozenset(ids))


def header_line(request: BuiltinRequest) -> list[str]:
    """The header's word on a built-in suite left out: a job that checks only its own tests says so."""
    return [f"gpuregress built-in cases: not collected: {request.left_out_by}"] if not request.wanted else []


def wanted(request: BuiltinRequest, case_id: str) -> bool:
    return request.only is None or any(fnmatchcase(case_id, pattern) for pattern in request.only)


def unknown_cases(request: BuiltinRequest, known: set[str]) -> str | None:
    """The usage error for ``gpuregress::<case>`` arguments that name no case of this configuration."""
    unknown = sorted(p for p in request.only or () if not any(fnmatchcase(case_id, p) for case_id in known))
    if not unknown:
        return None
    return (f"no built-in case {', '.join(f'{ROOT}::{u}' for u in unknown)} in this configuration (a model's cases "
            f"exist only with its --gpuregress-model); list them with: pytest --gpuregress --collect-only -q {ROOT}")
