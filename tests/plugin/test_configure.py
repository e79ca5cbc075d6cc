"""Building the session once --gpuregress is on (plugin/configure.py): each bad input is one usage error naming
its option, a good one gives a session wired to pytest's capture and terminal, and ranks' progress reaches the
terminal at most once a second (every 10 s in a CI log, never with -q). A stand-in for pytest's config: no run."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_gpuregress.plugin import configure
from pytest_gpuregress.plugin.configure import build_session, progress_printer
from pytest_gpuregress.plugin.options import Options
from pytest_gpuregress.training.model_specs import ModelSpec


class Terminal:
    """pytest's terminal reporter, as far as the progress printer uses it; ``events``: what it wrote, in order."""

    def __init__(self, isatty: bool, events: list[tuple[Any, ...]] | None = None) -> None:
        self.isatty = isatty
        self.events = [] if events is None else events

    @property
    def lines(self) -> list[str]:
        return [event[1] for event in self.events if event[0] == "line"]

    def write_line(self, line: str) -> None:
        self.events.append(("line", line))


class Capture:
    """pytest's capture manager, as far as the session uses it; ``events``: each call, in order."""

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self.events = events

    def suspend_global_capture(self, in_: bool = False) -> None:
        self.events.append(("suspend", in_))

    @contextmanager
    def global_and_fixture_disabled(self) -> Iterator[None]:
        self.events.append(("capture off",))
        yield
        self.events.append(("capture on",))


def fake_config(root: Path, verbosity: int = 0, **plugins: Any) -> Any:
    """What build_session and progress_printer read of a pytest.Config: no cache, the rootdir, the plugins by name."""
    return SimpleNamespace(cache=None, rootpath=root, pluginmanager=SimpleNamespace(getplugin=plugins.get),
                           get_verbosity=lambda: verbosity, addinivalue_line=lambda name, line: None)


def refused(root: Path, **options: Any) -> str:
    """The usage error build_session raises for ``options`` (on the CPU unless they say otherwise)."""
    with pytest.raises(pytest.UsageError) as error:
        build_session(fake_config(root), Options(enabled=True, **{"device": "cpu", "artifacts": root / "artifacts",
                                                                  **options}))
    return str(error.value)


def test_a_token_file_without_a_model_is_a_usage_error_naming_the_option(tmp_path: Path) -> None:
    """The built-in models train on their own synthetic data: --gpuregress-tokens feeds the models given."""
    assert refused(tmp_path, tokens=tmp_path / "traffic.npy").startswith(f"--gpuregress-tokens {tmp_path / 'traffic.npy'}: ")


def test_a_model_transformers_cannot_build_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "ghost.json"
    config.write_text(json.dumps({"model_type": "no-such-architecture"}))
    message = refused(tmp_path, models=(ModelSpec(name="ghost", source=str(config)),))
    assert message.startswith(f"--gpuregress-model {config}: ")


def test_a_broken_known_issues_file_is_a_usage_error_naming_the_ini_key(tmp_path: Path) -> None:
    issues = tmp_path / "issues.toml"
    issues.write_text("[[issue]]\nid = 'x'\n")  # its other required keys missing
    assert refused(tmp_path, known_issues=issues).startswith("gpuregress_known_issues: ")


def test_a_gpu_asked_for_on_a_machine_without_one_is_a_usage_error(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert refused(tmp_path, device="cuda").startswith("--gpuregress-device cuda: ")


def test_a_good_session_reads_the_known_issues_and_speaks_through_pytests_capture_and_terminal(tmp_path: Path) -> None:
    """The shipped known issues are loaded; a rank in place that times out suspends pytest's capture (not stdin),
    and ranks' progress is printed on the terminal with capture off."""
    events: list[tuple[Any, ...]] = []
    capture, terminal = Capture(events), Terminal(isatty=True, events=events)
    core = build_session(fake_config(tmp_path, capturemanager=capture, terminalreporter=terminal),
                         Options(enabled=True, device="cpu", artifacts=tmp_path / "artifacts"))
    assert core.known_issues and all(issue.id for issue in core.known_issues)
    assert core.places.user_root == tmp_path / "reference_runs"
    assert core.launches.progress is not None  # without a terminal it stays None (below)
    core.launches.uncapture()
    core.launches.progress("fsdp: step 3/8")
    assert events == [("suspend", False), ("capture off",), ("line", "  gpuregress fsdp: step 3/8"), ("capture on",)]


def clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """A monotonic clock the test sets."""
    now = [1000.0]
    monkeypatch.setattr(configure.time, "monotonic", lambda: now[0])
    return lambda t: now.__setitem__(0, t)


@pytest.mark.parametrize(("isatty", "every"), [(True, 1.0), (False, 10.0)])
def test_progress_is_printed_at_most_once_per_period(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     isatty: bool, every: float) -> None:
    """On a terminal a line per second, in a CI log (not a tty) one per 10 s: the lines between are dropped."""
    set_time = clock(monkeypatch)
    terminal = Terminal(isatty)
    show = progress_printer(fake_config(tmp_path, terminalreporter=terminal))
    assert show is not None
    for t, line in [(1000.0, "step 1"), (1000.0 + every / 2, "step 2"), (1000.0 + every, "step 3")]:
        set_time(t)
        show(line)
    assert terminal.lines == ["  gpuregress step 1", "  gpuregress step 3"]


def test_no_progress_with_q_or_without_a_terminal(tmp_path: Path) -> None:
    assert progress_printer(fake_config(tmp_path, verbosity=-1, terminalreporter=Terminal(True))) is None
    assert progress_printer(fake_config(tmp_path)) is None
