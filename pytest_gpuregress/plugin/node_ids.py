"""Node ids as a user types them: the built-in cases' (``gpuregress::fsdp``) and a project's own tests'."""

from __future__ import annotations

import os

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
