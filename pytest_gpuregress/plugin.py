"""The pytest plugin: options, header, the built-in suite, fixtures, markers and the summary.

Without ``--gpuregress`` the plugin only registers its options and markers, skips tests that need
it, and imports nothing heavy: torch is imported only once the flag is on.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .options import Options, add_options, check_reference_dir_argument

if TYPE_CHECKING:
    from .session import GpuRegressSession

SESSION_KEY = pytest.StashKey["GpuRegressSession"]()
OPTIONS_KEY = pytest.StashKey[Options]()
USER_ARGS_KEY = pytest.StashKey[bool]()
SUITE_FILE = Path(__file__).resolve().parent / "suite" / "test_gpuregress_suite.py"
FIXTURES = {"gpuregress"}
MARKERS = {
    "gpuregress": "a numerics regression test of pytest-gpuregress; runs only with --gpuregress",
    "gpuregress_training": "built-in training scenario compared with its stored reference",
    "gpuregress_collectives": "built-in collective case checked against its closed-form result",
}


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    add_options(parser)
    # Registered now, not during pytest_configure: a plugin registered inside that hook has it
    # replayed at once, before the cache plugin is configured.
    pluginmanager.register(_LateConfigure(), "gpuregress-session")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    options = Options.from_config(config)
    config.stash[OPTIONS_KEY] = options
    if not options.enabled:
        return
    check_reference_dir_argument(config)
    # The built-in suite always runs; tests the user named run beside it.
    user_gave_paths = bool(config.option.file_or_dir)
    config.stash[USER_ARGS_KEY] = user_gave_paths
    if user_gave_paths:
        config.args = [*config.args, str(SUITE_FILE)]
    else:
        config.args = [str(SUITE_FILE)]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Our own errors carry complete messages; show them without the plugin's internal traceback."""
    from .errors import GpuRegressError
    from .session import RegressionFailure

    try:
        return (yield)
    except (GpuRegressError, RegressionFailure) as exc:
        kind = "regression" if isinstance(exc, RegressionFailure) else type(exc).__name__
        message = f"gpuregress {kind}: {exc}"
    pytest.fail(message, pytrace=False)  # outside the except block: no chained traceback


def _session(config: pytest.Config) -> GpuRegressSession:
    return config.stash[SESSION_KEY]


class _LateConfigure:
    """A second pytest_configure that runs after the cache plugin: it builds the session."""

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        if not config.stash[OPTIONS_KEY].enabled:
            return
        from .errors import UnsupportedPlatform
        from .session import GpuRegressSession

        cache = getattr(config, "cache", None)
        output = cache.mkdir("gpuregress-runs") if cache is not None else None
        try:
            config.stash[SESSION_KEY] = GpuRegressSession(config.stash[OPTIONS_KEY], config.rootpath, output)
        except UnsupportedPlatform as exc:
            raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    options = config.stash.get(OPTIONS_KEY, None)
    if options is None or not options.enabled:
        return None
    from .fingerprint import collect, header_lines

    session = _session(config)
    plat = session.platform
    lines = header_lines(collect(plat.device_kind, plat.backend, plat.world_size))
    mode = "in place under torchrun" if plat.in_place else "spawned locally"
    lines.append(
        f"gpuregress run: {plat.world_size} {plat.backend} ranks on {plat.device_kind} ({mode}); "
        f"{'RECORDING' if options.record else 'comparing'} references in {session.user_reference_root}"
        + ("" if options.record else f" (else shipped: {session.shipped_reference_root})")
    )
    if options.inject:
        lines.append(f"gpuregress faults injected: {'; '.join(options.inject)}")
    if session.protocol_pinning_ignored:
        lines.append(f"gpuregress: NCCL protocol/algorithm pinning does not apply to {plat.backend}; "
                     "the collective sweep runs once with the backend's default")
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "collective_case" not in metafunc.fixturenames:
        return
    session = metafunc.config.stash.get(SESSION_KEY, None)
    ids = [c.id for c in session.collectives.all_cases()] if session is not None else ["collectives"]
    metafunc.parametrize("collective_case", ids, ids=ids)


def _wants_gpuregress(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    return bool(names & FIXTURES) or item.get_closest_marker("gpuregress") is not None


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected: the sweep runs what is left
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    options = config.stash[OPTIONS_KEY]
    if not options.enabled:
        skip = pytest.mark.skip(reason="gpuregress test: pass --gpuregress to run it")
        for item in items:
            if _wants_gpuregress(item):
                item.add_marker(skip)
        return
    # With --gpuregress, the user's paths contribute only tests that use the plugin.
    keep = [i for i in items if _wants_gpuregress(i)]
    dropped = [i for i in items if not _wants_gpuregress(i)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    session = config.stash[SESSION_KEY]
    chosen = {i.callspec.params["collective_case"] for i in items
              if hasattr(i, "callspec") and "collective_case" in i.callspec.params}
    session.collectives.selected = [c for c in session.collectives.all_cases() if c.id in chosen]


@pytest.fixture(scope="session")
def gpuregress(request: pytest.FixtureRequest) -> GpuRegressSession:
    """The gpuregress session: run scenarios on every rank and check them against references.

    Example, a user's own training loop::

        def test_my_model(gpuregress):
            record = gpuregress.run("mypkg.regress:train", config={"steps": 50})
            gpuregress.check(record, name="my-model")
    """
    options = request.config.stash[OPTIONS_KEY]
    if not options.enabled:
        pytest.skip("gpuregress test: pass --gpuregress to run it")
    return _session(request.config)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if SESSION_KEY not in config.stash:
        return
    session = config.stash[SESSION_KEY]
    if session.outcomes:
        terminalreporter.section("gpuregress")
    for outcome in session.outcomes:
        lane = f" [{outcome.lane} lane]" if outcome.lane else ""
        terminalreporter.write_line(
            f"{outcome.scenario} {outcome.platform_key}: {outcome.verdict.upper()}{lane} {outcome.detail}"
        )
        for note in outcome.notes:
            terminalreporter.write_line(f"    note: {note}")
    _collectives_summary(terminalreporter, session)


def _collectives_summary(terminalreporter: Any, session: GpuRegressSession) -> None:
    sweep = session.collectives
    if not sweep.timings and not sweep.failures:
        return
    write = terminalreporter.write_line
    plat = session.platform
    terminalreporter.section("gpuregress collectives")
    for protocol, seconds in sweep.timings.items():
        where = f", record in {sweep.saved[protocol]}" if protocol in sweep.saved else ""
        write(f"protocol {protocol}: {sum(1 for c in sweep.selected if c.protocol == protocol)} cases on "
              f"{plat.world_size} {plat.backend} ranks in {seconds:.1f}s{where}")
    if session.protocol_pinning_ignored:
        write(f"NCCL protocol/algorithm pinning does not apply to {plat.backend}: ran the default sweep once")
    for line in sweep.protocol_table():
        write(line)
    dtype = "bf16" if plat.device_kind == "cuda" else "fp32"
    for protocol in sweep.timings:
        rows = sweep.bandwidth_table(dtype, protocol, op="all_reduce", reduce_op="sum")
        if len(rows) > 1:
            write(f"all_reduce SUM {dtype} bandwidth, protocol {protocol} (full table: bandwidth.txt beside the saved record):")
            for row in rows:
                write(row)
