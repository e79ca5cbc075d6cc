"""The pytest plugin: options, header, the built-in suite, fixtures, markers and the summary.

Without ``--gpuregress`` the plugin only registers its options and markers, skips tests that need
it, and imports nothing heavy: no torch, numpy or scenario module (tests/test_startup.py checks).
Scenarios come from the registry (``pytest_gpuregress.scenarios``), loaded only once the flag is
on; nothing here names one.
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .options import BUILTIN_SCENARIO_OPTIONS, CORE_OPTIONS, Options, OptionSpec, add_options, check_reference_dir_argument

if TYPE_CHECKING:
    from .session import GpuRegressSession

SESSION_KEY = pytest.StashKey["GpuRegressSession"]()
OPTIONS_KEY = pytest.StashKey[Options]()
SUITE_FILE = Path(__file__).resolve().parent / "suite" / "test_gpuregress_suite.py"
FIXTURES = {"gpuregress"}
MARKERS = {
    "gpuregress": "a numerics regression test of pytest-gpuregress; runs only with --gpuregress",
    "gpuregress_training": "a built-in or plug-in training scenario, compared with its stored reference",
    "gpuregress_check": "a case of a check scenario, judged against its closed-form result",
}
PLUGIN_SPECS_KEY = pytest.StashKey[list[OptionSpec]]()  # plug-in scenarios' options, declared with --gpuregress


def _enabled_early(config: pytest.Config) -> bool:
    """--gpuregress on the command line (addopts included) or in the ini file, before the full parse."""
    flag = CORE_OPTIONS[0]
    cli = getattr(config.known_args_namespace, flag.dest, None)
    return bool(cli if cli is not None else config.getini(flag.ini_key))


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
    specs = _plugin_option_specs() if _enabled_early(early_config) else []
    add_options(parser, specs)
    early_config.stash[PLUGIN_SPECS_KEY] = specs


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    plugin_specs = config.stash.get(PLUGIN_SPECS_KEY, [])
    options = Options.from_config(config, [*BUILTIN_SCENARIO_OPTIONS, *plugin_specs])
    config.stash[OPTIONS_KEY] = options
    if not options.enabled or getattr(config.option, "help", False):  # --help lists the options; it runs nothing
        return
    if PLUGIN_SPECS_KEY not in config.stash:  # registered late (a conftest's pytest_plugins): still check plug-ins
        _plugin_option_specs()
    check_reference_dir_argument(config)
    refuse_xdist(config)
    # The built-in suite always runs; tests the user named run beside it.
    if config.option.file_or_dir:
        config.args = [*config.args, str(SUITE_FILE)]
    else:
        config.args = [str(SUITE_FILE)]


def refuse_xdist(config: pytest.Config) -> None:
    """Stop a --gpuregress run that pytest-xdist would spread over workers, naming the fix.

    The cases share the machine's devices, the launches several cases read, and one closing table: spread
    over workers, each would start its own ranks on the same GPUs and print a part of the summary."""
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or workers not in (None, 0, "0"):
        raise pytest.UsageError(
            f"--gpuregress cannot run under pytest-xdist (-n {workers}): its cases share this machine's devices, "
            "their launches and one closing summary, so they run in one process. Add -n 0 to the command line "
            "(it overrides an -n in addopts), or run with -p no:xdist")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Our own errors carry complete messages; show them without the plugin's internal traceback."""
    from ..errors import GpuRegressError, NotApplicable, RegressionFailure

    try:
        return (yield)
    except NotApplicable as exc:
        message = str(exc)
        skip = True
    except (GpuRegressError, RegressionFailure) as exc:
        kind = "regression" if isinstance(exc, RegressionFailure) else type(exc).__name__
        message = f"gpuregress {kind}: {exc}"
        skip = False
    if skip:
        pytest.skip(f"not applicable: {message}")
    pytest.fail(message, pytrace=False)  # outside the except block: no chained traceback


# The key figures of a test, attached as JUnit properties (record_property's mechanism).
JUNIT_FIGURES = ("lane", "first_differing_step", "worst_over_tolerance", "platform_key", "seconds", "wrong_elements",
                 "perf", "kernel_changes", "busiest_expert_share", "stack_changes", "faults_fired")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if SESSION_KEY in item.config.stash:
        _session(item.config).figures = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when != "call" or SESSION_KEY not in item.config.stash:
        return report
    figures = _session(item.config).figures
    # As record_property does: the item's properties reach JUnit through the teardown report.
    item.user_properties.extend((k, _junit_value(figures[k])) for k in JUNIT_FIGURES if figures.get(k) is not None)
    _html_extras(report, figures)
    return report


def _junit_value(value: Any) -> Any:
    """A list (the stack's changes) as one attribute value: "torch 2.12.0 -> 2.13.0; device.cpu_model: ..."."""
    return "; ".join(map(str, value)) if isinstance(value, list) else value


def _html_extras(report: pytest.TestReport, figures: dict[str, Any]) -> None:
    """The plot and the stack's changes in pytest-html's report, when pytest-html is installed."""
    try:
        from pytest_html import extras
    except ImportError:
        return
    added = []
    if figures.get("plot"):  # embedded, so the report is one file a CI can upload
        added.append(extras.png(base64.b64encode(Path(figures["plot"]).read_bytes()).decode(), name="comparison plot"))
    if figures.get("stack_changes"):
        added.append(extras.text("\n".join(figures["stack_changes"]), name="stack changes since the reference"))
    report.extras = [*getattr(report, "extras", []), *added]


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


def summary_table(outcomes: list[Any]) -> list[str]:
    """One row per scenario, then the command that reproduces each verdict that is not a pass."""
    if not outcomes:
        return []
    rows = [("scenario", "platform", "lane", "verdict", "worst/tol", "seconds")]
    rows += [(o.scenario, o.platform_key, o.lane or "-", o.verdict.upper(),
              "-" if o.worst is None else f"{o.worst:.2g}x", "-" if o.seconds is None else f"{o.seconds:.1f}")
             for o in outcomes]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["", *("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)]
    lines += [f"reproduce {o.scenario}: {o.reproduce}" for o in outcomes if o.reproduce]
    return lines


def _session(config: pytest.Config) -> GpuRegressSession:
    return config.stash[SESSION_KEY]


class _LateConfigure:
    """A second pytest_configure that runs after the cache plugin: it builds the session."""

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        if not config.stash[OPTIONS_KEY].enabled:
            return
        from ..errors import BadFaultSpec, BadKnownIssues, BadModel, BadTokens, UnsupportedPlatform
        from ..stack.known_issues import load_known_issues
        from ..training.model_specs import check_model
        from .session import GpuRegressSession

        cache = getattr(config, "cache", None)
        output = cache.mkdir("gpuregress-runs") if cache is not None else None
        try:
            session = GpuRegressSession(config.stash[OPTIONS_KEY], config.rootpath, output)
        except UnsupportedPlatform as exc:
            raise pytest.UsageError(str(exc)) from None
        except BadFaultSpec as exc:
            raise pytest.UsageError(f"--gpuregress-inject: {exc}") from None
        try:  # the shipped known issues and the user's (gpuregress_known_issues), read once and judged now
            session.known_issues = load_known_issues(session.options.known_issues)
        except BadKnownIssues as exc:
            raise pytest.UsageError(f"gpuregress_known_issues: {exc}") from None
        try:  # the user's models build (on the meta device) and fit; the token file reads and fits their vocabularies
            for model in session.options.models:
                check_model(model, session.platform.device_kind, session.platform.world_size)
            # Every config that trains on a token sample (the user's file, a factory's ids) describes it: read it now.
            if session.options.tokens is not None or any(m.factory for m in session.options.models):
                from ..scenarios import registry

                for scenario in registry().values():
                    scenario.default_config(session.setup)
                    for model in session.options.models if scenario.trains_user_models else ():
                        scenario.model_config(session.setup, model.name)
        except (BadModel, BadTokens) as exc:
            raise pytest.UsageError(str(exc)) from None
        config.stash[SESSION_KEY] = session
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            session.uncapture = lambda: capture.suspend_global_capture(in_=False)
        session.progress = progress_printer(config)
        for mark in sorted({m for _, case in session.all_cases() for m in case.marks}):
            config.addinivalue_line("markers", f"{mark}: a mark of a gpuregress scenario case")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    options = config.stash.get(OPTIONS_KEY, None)
    if options is None or not options.enabled:
        return None
    from ..scenarios import registry
    from ..stack.determinism import header_lines as determinism_lines
    from ..stack.fingerprint import collect, header_lines
    from ..stack.known_issues import header_lines as known_issue_lines
    from ..stack.known_issues import matching

    session = _session(config)
    plat = session.platform
    fingerprint = collect(plat.device_kind, plat.backend, plat.world_size)
    lines = header_lines(fingerprint)
    lines += determinism_lines(plat.device_kind)  # on a GPU, or where determinism cannot be had: why
    lines += known_issue_lines(matching(session.known_issues, fingerprint))
    mode = "in place under torchrun" if plat.in_place else "spawned locally"
    lines.append(
        f"gpuregress run: {plat.world_size} {plat.backend} ranks on {plat.device_kind} ({mode}); "
        f"{'RECORDING' if options.record else 'RECORDING missing and comparing' if options.record_missing else 'comparing'}"
        f" references in {session.user_reference_root}"
        + ("" if options.record else f" (else shipped: {session.shipped_reference_root})")
    )
    lines += session.rank_header()
    lines.append(f"gpuregress artifacts: {session.output_dir} (failed runs, plots, logs; --gpuregress-artifacts)")
    if options.inject:
        lines.append(f"gpuregress faults injected: {'; '.join(options.inject)}")
    if plat.in_place:
        from ..launch.net import exposed_addresses

        exposed = exposed_addresses()
        if exposed:
            lines.append(
                f"gpuregress WARNING: this rank and its torchrun agent listen beyond loopback on {', '.join(exposed)}: "
                "on one machine bind the store with --rdzv-endpoint=127.0.0.1:PORT (static: --master-addr=127.0.0.1), "
                "across machines choose the interface with --local-addr"
            )
    for scenario in registry().values():
        lines += scenario.header(session.setup)
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "gpuregress_case" not in metafunc.fixturenames:
        return
    from .session import test_id

    session = metafunc.config.stash.get(SESSION_KEY, None)
    if session is None:
        metafunc.parametrize("gpuregress_case", [("", "")], ids=["gpuregress"])
        return
    params = []
    for scenario, case in session.all_cases():
        kind_mark = pytest.mark.gpuregress_training if scenario.kind == "training" else pytest.mark.gpuregress_check
        marks = [kind_mark, *(getattr(pytest.mark, m) for m in case.marks)]
        shortfall = session.rank_shortfall(case)
        if shortfall:  # collected and skipped with the reason: never a silent pass or a missing test
            marks.append(pytest.mark.skip(reason=shortfall))
        params.append(pytest.param((scenario.name, case.id), id=test_id(scenario, case), marks=marks))
    metafunc.parametrize("gpuregress_case", params)


def _wants_gpuregress(item: pytest.Item) -> bool:
    names = set(getattr(item, "fixturenames", ()))
    return bool(names & FIXTURES) or item.get_closest_marker("gpuregress") is not None


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected: launches carry what is left
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
    chosen = {tuple(i.callspec.params["gpuregress_case"]) for i in items
              if hasattr(i, "callspec") and "gpuregress_case" in i.callspec.params}
    config.stash[SESSION_KEY].select(chosen)  # type: ignore[arg-type]


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


def pytest_unconfigure(config: pytest.Config) -> None:
    if SESSION_KEY in config.stash:
        config.stash[SESSION_KEY].close()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if SESSION_KEY not in config.stash:
        return
    from ..scenarios import registry

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
    for line in summary_table(session.outcomes):
        terminalreporter.write_line(line)
    if session.outcomes:
        terminalreporter.write_line(f"artifacts (failed runs, plots, logs): {session.output_dir}")
    for name, launched in session.launched.items():
        scenario = registry()[name]
        records = {key: (None if isinstance(r, Exception) else r) for key, r in launched.items()}
        lines = scenario.summary(records, session.setup)
        lines += [f"{key}: record in {path}" for (sc, key), path in session.saved.items() if sc == name]
        if lines:
            terminalreporter.section(f"gpuregress {name}")
            for line in lines:
                terminalreporter.write_line(line)
