"""The plugin's hooks (pytest_gpuregress/plugin/__init__.py): the markers it registers, our errors shown as one
line (a skip for what cannot apply, a failure without the plugin's traceback), the marking of the project's
gpuregress tests, and the refusal of pytest-xdist. In-process pytest runs that train nothing, and stand-ins."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pytest_gpuregress.plugin import COLLECTED_KEY, MARKERS, OPTIONS_KEY, pytest_collection_modifyitems, refuse_xdist
from pytest_gpuregress.plugin.options import Options

RAISING_TESTS = """
from pytest_gpuregress.errors import NotApplicable, NotSupported, RankFailure, RegressionFailure

def test_unsupported():
    raise NotSupported("gloo lacks all_to_all")

def test_not_applicable():
    raise NotApplicable("one rank")

def test_regression():
    raise RegressionFailure("loss moved at step 3")

def test_rank_failure():
    raise RankFailure("rank 1 hung")

def test_plain_assert():
    assert 1 == 2
"""


def test_the_plugins_markers_are_registered(pytester: pytest.Pytester) -> None:
    """Without --gpuregress too, so ``-m gpuregress_training`` and ``--strict-markers`` know them."""
    config = pytester.parseconfigure("-p", "no:cacheprovider")
    registered = {line.split(":", 1)[0] for line in config.getini("markers")}
    assert set(MARKERS) == {"gpuregress", "gpuregress_training", "gpuregress_check"} and set(MARKERS) <= registered


def test_our_errors_are_skips_or_one_line_failures_and_other_errors_keep_their_traceback(
        pytester: pytest.Pytester) -> None:
    """What cannot apply here is a skip saying why; a regression or our own error fails with its message alone
    (no traceback into the plugin); any other exception is pytest's as always."""
    pytester.makepyfile(test_raising=RAISING_TESTS)
    reprec = pytester.inline_run("-p", "no:cacheprovider")
    reprec.assertoutcome(passed=0, skipped=2, failed=3)
    calls = {r.nodeid.split("::")[1]: r for r in reprec.getreports("pytest_runtest_logreport") if r.when == "call"}
    assert calls["test_unsupported"].longrepr[2] == "Skipped: not supported: gloo lacks all_to_all"
    assert calls["test_not_applicable"].longrepr[2] == "Skipped: not applicable: one rank"
    assert str(calls["test_regression"].longrepr) == "gpuregress regression: loss moved at step 3"
    assert str(calls["test_rank_failure"].longrepr) == "gpuregress RankFailure: rank 1 hung"
    assert "assert 1 == 2" in str(calls["test_plain_assert"].longrepr)  # untouched: pytest's own report


class Item:
    """A collected test, as far as the marking hook reads and marks it."""

    def __init__(self, fixtures: tuple[str, ...] = (), marked: bool = False) -> None:
        self.fixturenames = fixtures
        self.marked = marked
        self.added: list[str] = []

    def get_closest_marker(self, name: str) -> Any:
        return object() if self.marked and name == "gpuregress" else None

    def add_marker(self, mark: Any) -> None:
        self.added.append(mark.name)


@pytest.mark.parametrize(("enabled", "added"), [(True, "gpuregress"), (False, "skip")])
def test_the_projects_gpuregress_tests_are_marked_or_skipped(enabled: bool, added: str) -> None:
    """A test using the ``gpuregress`` fixture or its mark is marked ``gpuregress`` with the flag (so ``-m
    gpuregress`` selects it), skipped without it; another test is left alone, and collection is noted done."""
    config = SimpleNamespace(stash=pytest.Stash())
    config.stash[OPTIONS_KEY] = Options(enabled=enabled)
    uses, marked, plain = Item(fixtures=("tmp_path", "gpuregress")), Item(marked=True), Item(fixtures=("tmp_path",))
    pytest_collection_modifyitems(config, [uses, marked, plain])  # type: ignore[arg-type,list-item]
    assert (uses.added, marked.added, plain.added) == ([added], [added], [])
    assert config.stash[COLLECTED_KEY] is True


@pytest.mark.parametrize(("numprocesses", "worker", "refused"), [
    (2, False, True), ("auto", False, True), (None, True, True), (None, False, False), (0, False, False),
    ("0", False, False)])
def test_a_run_under_xdist_is_refused(numprocesses: object, worker: bool, refused: bool) -> None:
    """-n N (or being one of xdist's workers) would start ranks per worker on the same devices: refused naming the
    -n given; -n 0 and no -n run."""
    config = SimpleNamespace(option=SimpleNamespace(numprocesses=numprocesses))
    if worker:
        config.workerinput = {"workerid": "gw0"}
    if not refused:
        refuse_xdist(config)  # type: ignore[arg-type]
        return
    with pytest.raises(pytest.UsageError, match=rf"\(-n {numprocesses}\)"):
        refuse_xdist(config)  # type: ignore[arg-type]
