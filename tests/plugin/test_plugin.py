"""The plugin's pytest surface, through pytester: options, ini keys, collection, skipping."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..conftest import FSDP_ONLY, listed

USER_TESTS = """
import sys
import pytest

def test_plain():
    # without --gpuregress the plugin must not have imported torch
    assert "torch" not in sys.modules

def test_uses_plugin(gpuregress):
    assert gpuregress.options.steps == 7

@pytest.mark.gpuregress
def test_marked():
    pass
"""


def test_without_the_flag_tests_are_skipped_and_torch_is_not_imported(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*pass --gpuregress to run it*"])


PROJECT_TESTS = """
def test_plain():
    pass

def test_fails():
    assert 1 == 2

def test_my_mlp(gpuregress):
    assert gpuregress.options.enabled
"""


def test_the_flag_adds_the_builtin_suite_to_a_projects_own_tests(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntestpaths = tests\n")
    pytester.mkdir("tests")
    pytester.makepyfile(**{"tests/test_mine": PROJECT_TESTS})
    everything = listed(pytester.runpytest("--gpuregress", "--collect-only", "-q"))
    assert everything[:3] == ["tests/test_mine.py::test_plain", "tests/test_mine.py::test_fails",
                              "tests/test_mine.py::test_my_mlp"]
    assert "gpuregress::fsdp" in everything and len(everything) > 1000
    # -k and -m select either, in pytest's own terms
    assert listed(pytester.runpytest("--gpuregress", "--collect-only", "-q", "-k", "my_mlp")) == \
        ["tests/test_mine.py::test_my_mlp"]
    assert listed(pytester.runpytest("--gpuregress", "--collect-only", "-q", "-k", "fsdp and resume")) == \
        ["gpuregress::fsdp-resume"]
    by_marker = listed(pytester.runpytest("--gpuregress", "--collect-only", "-q", "-m", "gpuregress"))
    assert "tests/test_mine.py::test_my_mlp" in by_marker and "tests/test_mine.py::test_plain" not in by_marker
    # --lf after a failing test of the project reruns that test only
    pytester.runpytest("--gpuregress", "-k", "plain or fails").assert_outcomes(passed=1, failed=1)
    assert listed(pytester.runpytest("--gpuregress", "--lf", "--collect-only", "-q")) == \
        ["tests/test_mine.py::test_fails"]
    # the built-in suite left out, by option or ini key; named among paths, it is there
    mine = ["tests/test_mine.py::test_plain", "tests/test_mine.py::test_fails", "tests/test_mine.py::test_my_mlp"]
    assert listed(pytester.runpytest("--gpuregress", "--gpuregress-no-builtin", "--collect-only", "-q")) == mine
    assert listed(pytester.runpytest("--gpuregress", "--collect-only", "-q", "tests")) == mine  # paths narrow
    said = ("gpuregress built-in cases: not collected: the paths given (tests) narrow collection; name gpuregress "
            "among them to add the built-in cases")
    pytester.runpytest("--gpuregress", "--collect-only", "tests").stdout.fnmatch_lines([said])  # in the header
    quiet = pytester.runpytest("--gpuregress", "-q", "-k", "plain", "tests")  # -q hides it: the summary says it
    quiet.assert_outcomes(passed=1)
    quiet.stdout.fnmatch_lines(["*= gpuregress =*", said])
    assert listed(pytester.runpytest("--gpuregress", "--collect-only", "-q", "gpuregress::fsdp",
                                     "tests/test_mine.py::test_my_mlp")) == \
        ["tests/test_mine.py::test_my_mlp", "gpuregress::fsdp"]
    pytester.makeini("[pytest]\ntestpaths = tests\ngpuregress_no_builtin = true\n")
    assert listed(pytester.runpytest("--gpuregress", "--collect-only", "-q")) == mine


def test_a_builtin_case_named_that_does_not_exist_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--gpuregress", "--collect-only", "-q", "gpuregress::fsdp-tiny-nothing")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*no built-in case gpuregress::fsdp-tiny-nothing in this configuration*"
                                 "pytest --gpuregress --collect-only -q gpuregress"])


def test_builtin_suite_runs_from_any_directory_and_selects_by_scenario(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--gpuregress", "--collect-only", "-q", "-k", "fsdp")
    result.stdout.fnmatch_lines(["gpuregress::fsdp", "gpuregress::fsdp-resume", "gpuregress::fsdp-bf16",
                                 "gpuregress::triage-equivalence-fsdp", "gpuregress::triage-oracle-fsdp",
                                 "5/* tests collected (* deselected)*"])
    result = pytester.runpytest("--gpuregress", "--collect-only", "-q", "-k", "equivalence")
    result.stdout.fnmatch_lines(["gpuregress::triage-equivalence-fsdp", "1/* tests collected (* deselected)*"])
    result = pytester.runpytest("--gpuregress", "--collect-only", "-q", "-k", "all_reduce and bf16 and n1024")
    result.stdout.fnmatch_lines(["gpuregress::collectives-all_reduce-sum-bf16-n1024-inplace",
                                 "gpuregress::collectives-all_reduce-avg-bf16-n1024-inplace"])
    assert "fsdp" not in result.stdout.str()


def test_ini_keys_set_options(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpuregress = true\ngpuregress_steps = 7\ngpuregress_device = cpu\n")
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("-k", "uses_plugin", "test_user.py")
    assert result.parseoutcomes()["passed"] == 1 and "failed" not in result.parseoutcomes()


def test_command_line_beats_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpuregress_steps = 3\n")
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("--gpuregress", "--gpuregress-steps", "7", "-k", "uses_plugin", "test_user.py")
    assert result.parseoutcomes()["passed"] == 1 and "failed" not in result.parseoutcomes()


def test_header_shows_the_stack_fingerprint(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--gpuregress", "--collect-only", "--gpuregress-device=cpu")
    result.stdout.fnmatch_lines([
        "gpuregress stack: torch *, transformers *, peft *, accelerate *, safetensors *",
        "gpuregress device: cpu *",
        "gpuregress numerics: blas *",
        "gpuregress run: 2 gloo ranks on cpu (spawned locally); comparing references in *",
    ])


@pytest.mark.full_tier  # 14 s; its harmless twin stays fast: the fast tier stays within its time
def test_reference_dir_as_two_words_fails_clearly_when_it_moves_the_rootdir(
    pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytester.makeini("[pytest]\ngpuregress_steps = 7\n")
    elsewhere = tmp_path_factory.mktemp("refs-elsewhere")
    result = pytester.runpytest_subprocess("--gpuregress", "--collect-only", "--gpuregress-reference-dir", str(elsewhere))
    result.stderr.fnmatch_lines([f"*Write it as one word: --gpuregress-reference-dir={elsewhere}*"])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result = pytester.runpytest_subprocess("--gpuregress", "--collect-only", f"--gpuregress-reference-dir={elsewhere}")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([f"*comparing references in {elsewhere}*", "configfile: tox.ini*"])


def test_reference_dir_as_two_words_is_fine_when_harmless(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    Path(pytester.path, "refs").mkdir()
    result = pytester.runpytest_subprocess("--gpuregress", "--collect-only", "--gpuregress-reference-dir", "refs")
    assert result.ret == pytest.ExitCode.OK, result.stderr.str()


def test_cuda_requested_on_a_cpu_machine_is_a_clear_usage_error(pytester: pytest.Pytester) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = pytester.runpytest_subprocess("--gpuregress", "--gpuregress-device=cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*sees no GPU*--gpuregress-device cpu*"])


def test_bad_ini_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpuregress_lane = fuzzy\n")
    result = pytester.runpytest_subprocess("--gpuregress", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*gpuregress_lane = 'fuzzy': must be one of*"])


def test_the_record_hint_carries_a_scenarios_own_options(pytester: pytest.Pytester) -> None:
    """A scenario option that shapes the stored config must reach the command that records it."""
    from pytest_gpuregress.plugin.options import Options
    from pytest_gpuregress.plugin.session import GpuRegressSession

    options = Options(enabled=True, device="cpu", steps=8,
                      scenario_values={"gpuregress_lora_targets": ["q_proj", "v_proj"],
                                       "gpuregress_collectives_repeats": 3})
    hint = GpuRegressSession(options, pytester.path).places.record_hint(["gpuregress::lora-fully_shard"])
    assert "--gpuregress-steps=8" in hint and "--gpuregress-lora-targets=q_proj,v_proj" in hint
    assert "collectives-repeats" not in hint  # at its default


def test_printed_record_commands_never_write_into_the_shipped_references(pytester: pytest.Pytester) -> None:
    # Inside the plugin's own checkout the user's folder is the shipped one: a pasted command would overwrite it.
    from pytest_gpuregress.plugin.options import Options
    from pytest_gpuregress.plugin.session import GpuRegressSession
    from pytest_gpuregress.resources import shipped_dir

    shipped = shipped_dir("reference_runs")
    places = GpuRegressSession(Options(enabled=True, device="cpu"), shipped.parent).places
    assert places.user_root.resolve() == shipped.resolve()
    loc = places.location("fsdp", "cpu-gloo-w2-fp32")
    hint, elsewhere = loc.record_hint, loc.record_elsewhere_hint
    assert f"--gpuregress-reference-dir={shipped}-recorded" in hint
    assert f"--gpuregress-reference-dir={shipped}-recorded-this-stack" in elsewhere
    # A user's own folder is where the plain command records; a stack whose model changed gets a folder of its own.
    own = GpuRegressSession(Options(enabled=True, device="cpu"), pytester.path).places
    assert f"--gpuregress-reference-dir={pytester.path / 'reference_runs'} " in own.record_hint(["gpuregress::fsdp"]) + " "
    assert f"--gpuregress-reference-dir={pytester.path / 'reference_runs-this-stack'}" in \
        own.location("fsdp", "cpu-gloo-w2-fp32").record_elsewhere_hint


def test_gpuregress_under_xdist_stops_with_the_fix_and_runs_with_n_0(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\naddopts = -n 2\n")  # what many users keep
    refused = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpuregress", "--collect-only", "-q")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*--gpuregress cannot run under pytest-xdist (-n 2): *Add -n 0 to the command line*"])
    allowed = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gpuregress", "--collect-only", "-q",
                                            "-n", "0", "-k", FSDP_ONLY)
    assert allowed.ret == pytest.ExitCode.OK
    allowed.stdout.fnmatch_lines(["*gpuregress::fsdp*"])
    plain = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q")  # no flag: untouched
    assert plain.ret in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)


@pytest.mark.full_tier  # three pytest sessions: the fast tier stays within its time
def test_record_missing_records_only_what_is_missing_and_compares_the_rest(pytester: pytest.Pytester) -> None:
    """A first run on a new platform: the missing reference is recorded (never an existing one overwritten), and
    a second run compares with it."""
    refs = pytester.path / "refs"
    args = ["-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={refs}", "--gpuregress-steps=4",
            "--gpuregress-replicas=0", "-k", "formats-quantized-per_tensor_e4m3fn"]
    first = pytester.runpytest_subprocess(*args, "--gpuregress-record-missing")
    first.assert_outcomes(passed=3)  # the three per-tensor schemes share one reference
    first.stdout.fnmatch_lines(["*RECORDING missing and comparing references in *",
                                "*formats*cpu-gloo-w2-fp32*RECORDED*"])
    manifest = refs / "formats" / "cpu-gloo-w2-fp32" / "manifest.json"
    written = manifest.read_text()
    again = pytester.runpytest_subprocess(*args, "--gpuregress-record-missing")
    again.assert_outcomes(passed=3)
    assert "RECORDED" not in again.stdout.str() and manifest.read_text() == written  # compared, not overwritten
    plain = pytester.runpytest_subprocess(*args)
    plain.assert_outcomes(passed=3)


def test_an_error_inside_a_built_in_case_shows_from_the_case_on(pytester: pytest.Pytester) -> None:
    """An unexpected error (a bug of ours) in a built-in case: its traceback starts at the case, as a test
    function's does, not in pytest's and pluggy's frames."""
    pytester.makeconftest("""
from pytest_gpuregress.plugin.session import GpuRegressSession

def broken(self, scenario, case_id):
    raise ValueError("a bug inside the plugin")

GpuRegressSession.run_case = broken
""")
    # a process of its own: the conftest breaks the session class for the process that loads it
    result = pytester.runpytest_subprocess("--gpuregress", "-p", "no:cacheprovider", "gpuregress::fsdp")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ValueError: a bug inside the plugin", "FAILED gpuregress::fsdp - ValueError*"])
    failures = result.stdout.str().split("= FAILURES =")[1].split("short test summary info")[0]
    assert "pluggy" not in failures and "_pytest" not in failures


def test_a_path_that_does_not_exist_is_the_error_shown_not_a_later_check(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--gpuregress", f"--gpuregress-reference-dir={pytester.path / 'missing'}",
                                "tests/tset_typo.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*file or directory not found: tests/tset_typo.py*"])
    assert "does not exist, and a comparing run only reads references" not in result.stderr.str()
