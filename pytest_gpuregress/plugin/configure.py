"""Building the session once --gpuregress is on: every bad input becomes one usage line naming the option."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pytest

from .options import Options
from .session import GpuRegressSession


def build_session(config: pytest.Config, options: Options) -> GpuRegressSession:
    from ..errors import BadFaultSpec, BadKnownIssues, BadModel, BadTokens, UnsupportedPlatform
    from ..stack.known_issues import load_known_issues

    cache = getattr(config, "cache", None)
    output = cache.mkdir("gpuregress-runs") if cache is not None else None
    try:
        session = GpuRegressSession(options, config.rootpath, output)
        # The shipped known issues and the user's (gpuregress_known_issues), read once and judged now.
        session.known_issues = load_known_issues(options.known_issues)
        _check_models_and_tokens(session)
    except (UnsupportedPlatform, BadModel, BadTokens) as exc:
        raise pytest.UsageError(str(exc)) from None
    except BadFaultSpec as exc:
        raise pytest.UsageError(f"--gpuregress-inject: {exc}") from None
    except BadKnownIssues as exc:
        raise pytest.UsageError(f"gpuregress_known_issues: {exc}") from None
    # Where ranks speak on the terminal: a rank in place that times out stops pytest's capture, so its last words
    # reach the console; spawned ranks print their progress.
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        session.launches.uncapture = lambda: capture.suspend_global_capture(in_=False)
    session.launches.progress = progress_printer(config)
    for mark in sorted({m for _, case in session.selection.all_cases() for m in case.marks}):
        config.addinivalue_line("markers", f"{mark}: a mark of a gpuregress scenario case")
    return session


def _check_models_and_tokens(session: GpuRegressSession) -> None:
    """The user's models build (on the meta device) and fit; the token file reads and fits their vocabularies: every
    config that trains on a token sample (the user's file, a factory's ids) describes it, so it is read now."""
    from ..errors import BadTokens
    from ..scenarios import registry
    from ..training.model_specs import check_model

    options = session.options
    if options.tokens is not None and not options.models:
        raise BadTokens(options.tokens, "feeds the models given with --gpuregress-model, and none is given (the "
                        "built-in models train on their own synthetic data)",
                        "add --gpuregress-model=<your config.json or module:factory>, or leave the option out")
    for model in options.models:
        check_model(model, session.platform.device_kind, session.platform.world_size)
    if options.tokens is None and not any(m.factory for m in options.models):
        return
    for scenario in registry().values():
        scenario.default_config(session.setup)
        for model in options.models if scenario.trains_user_models else ():
            scenario.model_config(session.setup, model.name)


def progress_printer(config: pytest.Config) -> Callable[[str], None] | None:
    """Ranks' progress on the terminal while they run: at most once a second on a terminal, every
    10 s in a CI log (not a tty), never with -q."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    capture = config.pluginmanager.getplugin("capturemanager")
    if reporter is None or config.get_verbosity() < 0:
        return None
    every = 1.0 if reporter.isatty else 10.0
    last = [0.0]

    def show(line: str) -> None:
        now = time.monotonic()
        if now - last[0] < every:
            return
        last[0] = now
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.write_line(f"  gpuregress {line}")

    return show
