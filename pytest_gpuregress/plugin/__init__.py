"""The pytest plugin: options, header, the built-in suite, fixtures, markers and the summary.

Without ``--gpuregress`` it registers options and markers only and imports no torch, numpy or scenario
(tests/plugin/test_startup.py checks). Nothing here names a scenario.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from ..option_spec import OptionSpec
from .options import BUILTIN_SCENARIO_OPTIONS, CORE_OPTIONS, ENABLED, Options, add_options, check_reference_dir_argument

if TYPE_CHECKING:
    from .collection import BuiltinRequest
    from .session import GpuRegressSession

SESSION_KEY = pytest.StashKey["GpuRegressSession"]()
OPTIONS_KEY = pytest.StashKey[Options]()
BUILTIN_KEY: pytest.StashKey[BuiltinRequest] = pytest.StashKey()
COLLECTED_KEY = pytest.StashKey[bool]()
MARKERS = {
    "gpuregress": "a numerics regression test of pytest-gpuregress; runs only with --gpuregress",
    "gpuregress_training": "a built-in or plug-in training scenario, compared with its stored reference",
    "gpuregress_check": "a case of a check scenario, judged against its closed-form result",
}
PLUGIN_SPECS_KEY = pytest.StashKey[list[OptionSpec]]()  # plug-in scenarios' options, declared with --gpuregress


def _plugin_option_specs() -> list[OptionSpec]:
    """Plug-in scenarios' own options. Loading the registry imports every scenario: only with --gpuregress,
    where a broken plug-in stops the run with one line naming it."""
    from ..errors import ScenarioProblem
    from ..scenarios import registry

    try:
        specs = [spec for sc in registry().values() for spec in sc.options]
    except ScenarioProblem as exc:
        raise pytest.UsageError(f"gpuregress scenarios: {exc}") from None
    return [spec for spec in specs if spec not in BUILTIN_SCENARIO_OPTIONS]


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    add_options(parser, [*CORE_OPTIONS, *BUILTIN_SCENARIO_OPTIONS])
    # Registered now, not during pytest_configure: a plugin registered inside that hook has it
    # replayed at once, before the cache plugin is configured.
    pluginmanager.register(_LateConfigure(), "gpuregress-session")


def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser) -> None:
    # The first hook that knows the flag yet still comes before the full parse: options declared here parse.
    # --gpuregress on the command line (addopts included) or in the ini file.
    cli = getattr(early_config.known_args_namespace, ENABLED.dest, None)
    enabled = cli if cli is not None else early_config.getini(ENABLED.ini_key)
    specs = _plugin_option_specs() if enabled else []
    add_options(parser, specs)
    early_config.stash[PLUGIN_SPECS_KEY] = specs


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    plugin_specs = config.stash.get(PLUGIN_SPECS_KEY, [])
    options = Options.from_config(config, [*BUILTIN_SCENARIO_OPTIONS, *plugin_specs])
    config.stash[OPTIONS_KEY] = options
    if not _runs(config):
        return
    if PLUGIN_SPECS_KEY not in config.stash:  # registered late (a conftest's pytest_plugins): still check plug-ins
        _plugin_option_specs()
    check_reference_dir_argument(config)
    refuse_xdist(config)
    from .collection import take_builtin_arguments

    config.stash[BUILTIN_KEY] = take_builtin_arguments(config, options.no_builtin)


def _runs(config: pytest.Config) -> bool:
    """--gpuregress is on, and this is no --help (which lists the options and runs nothing)."""
    return config.stash[OPTIONS_KEY].enabled and not getattr(config.option, "help", False)


def refuse_xdist(config: pytest.Config) -> None:
    """Stop a --gpuregress run that pytest-xdist would spread over workers (each would start its own ranks on the
    same GPUs and print a part of the summary), naming the fix."""
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or workers not in (None, 0, "0"):
        raise pytest.UsageError(
            f"--gpuregress cannot run under pytest-xdist (-n {workers}): its cases share this machine's devices, "
            "their launches and one closing summary, so they run in one process. Add -n 0 to the command line "
            "(it overrides an -n in addopts), or run with -p no:xdist")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Our own errors carry complete messages; show them without the plugin's internal traceback."""
    from ..errors import GpuRegressError, NotApplicable, NotSupported, RegressionFailure

    try:
        return (yield)
    except NotApplicable as exc:
        skipped, message = True, f"{'not supported' if isinstance(exc, NotSupported) else 'not applicable'}: {exc}"
    except (GpuRegressError, RegressionFailure) as exc:
        kind = "regression" if isinstance(exc, RegressionFailure) else type(exc).__name__
        skipped, message = False, f"gpuregress {kind}: {exc}"
    if skipped:
        pytest.skip(message)
    pytest.fail(message, pytrace=False)  # outside the except block: no chained traceback


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if SESSION_KEY in item.config.stash:
        from .collection import typed_node_id

        session = item.config.stash[SESSION_KEY]
        session.figures.clear()
        session.places.current_test = typed_node_id(item)  # a user's check names its reference: this test reads it


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" and SESSION_KEY in item.config.stash:
        from .reporting import attach_figures, cite_known_issues

        attach_figures(item, report, item.config.stash[SESSION_KEY].figures)
        cite_known_issues(item, report, item.config.stash[SESSION_KEY])
    return report


class _LateConfigure:
    """A second pytest_configure that runs after the cache plugin: it builds the session."""

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        if config.stash[OPTIONS_KEY].enabled:
            from .configure import build_session

            config.stash[SESSION_KEY] = build_session(config, config.stash[OPTIONS_KEY])


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if SESSION_KEY not in config.stash:  # built with --gpuregress only
        return None
    from .collection import header_line
    from .reporting import header_lines

    return header_lines(config.stash[SESSION_KEY]) + header_line(config.stash[BUILTIN_KEY])


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    """The built-in suite joins what the session collected from its paths, so it is counted, selected with -k and
    -m, and rerun with --lf like any test."""
    report = yield
    request = collector.config.stash.get(BUILTIN_KEY, None)
    if isinstance(collector, pytest.Session) and request is not None and request.wanted and report.passed:
        from .collection import ROOT
        from .suite.cases import BuiltinSuite

        report.result.append(BuiltinSuite.from_parent(collector, name=ROOT, nodeid=ROOT, request=request,
                                                       session_of=lambda: collector.config.stash[SESSION_KEY]))
    return report


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `-m gpuregress` selects the project's tests that use it too
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    enabled = config.stash[OPTIONS_KEY].enabled
    config.stash[COLLECTED_KEY] = True  # reached only when every path was collected
    skip = pytest.mark.skip(reason="gpuregress test: pass --gpuregress to run it")
    for item in items:
        if "gpuregress" in getattr(item, "fixturenames", ()) or item.get_closest_marker("gpuregress") is not None:
            item.add_marker(pytest.mark.gpuregress if enabled else skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """After -k, -m and --lf have chosen: launches carry the built-in cases left, and settings are checked before
    any rank starts (a comparison with other settings could only fail, after training)."""
    config = session.config
    if not _runs(config) or not config.stash.get(COLLECTED_KEY, False):  # collection failed: its own error says why
        return
    from .collection import unknown_cases
    from .selection import test_id
    from .settings_check import missing_folder, usage_message
    from .suite.cases import BuiltinCase

    gpuregress = config.stash[SESSION_KEY]
    gpuregress.selection.select({item.case for item in session.items if isinstance(item, BuiltinCase)})
    ids = {test_id(sc, case) for sc, case in gpuregress.selection.all_cases()}
    mismatch = unknown_cases(config.stash[BUILTIN_KEY], ids) or missing_folder(gpuregress) or usage_message(gpuregress)
    if mismatch:
        raise pytest.UsageError(mismatch)


@pytest.fixture(scope="session")
def gpuregress(request: pytest.FixtureRequest) -> GpuRegressSession:
    """The gpuregress session: run scenarios on every rank and check them against references.

    ``record = gpuregress.run("mypkg.regress:train", config={"steps": 50}); gpuregress.check(record, name="my-model")``
    """
    options = request.config.stash[OPTIONS_KEY]
    if not options.enabled:
        pytest.skip("gpuregress test: pass --gpuregress to run it")
    return request.config.stash[SESSION_KEY]


def pytest_unconfigure(config: pytest.Config) -> None:
    if SESSION_KEY in config.stash:
        config.stash[SESSION_KEY].close()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if SESSION_KEY not in config.stash:
        return
    from .collection import header_line
    from .reporting import closing_sections

    # A built-in suite left out is said again at the end: -q and --no-header hide the header.
    for title, lines in closing_sections(config.stash[SESSION_KEY], header_line(config.stash[BUILTIN_KEY])):
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
