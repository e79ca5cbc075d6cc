"""The plugin's pytest surface, through pytester: options, ini keys, collection, skipping."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import FSDP_ONLY

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


def test_flag_runs_only_plugin_tests_from_user_paths_plus_the_builtin_suite(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("--gpuregress", "--collect-only", "-q", ".")
    result.stdout.fnmatch_lines(["*test_user.py::test_uses_plugin*", "*test_user.py::test_marked*",
                                 "*test_scenario[[]fsdp[]]*"])
    assert "test_plain" not in result.stdout.str()


def test_builtin_suite_runs_from_any_directory_and_selects_by_scenario(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--gpuregress", "--collect-only", "-q", "-k", "fsdp")
    result.stdout.fnmatch_lines(["*test_scenario[[]fsdp[]]*", "*test_scenario[[]fsdp-resume[]]*",
                                 "*test_scenario[[]fsdp-bf16[]]*",
                                 "*test_scenario[[]triage-equivalence-fsdp[]]*", "*test_scenario[[]triage-oracle-fsdp[]]*",
                                 "5/* tests collected (* deselected)*"])
    result = pytester.runpytest("--gpuregress", "--collect-only", "-q", "-k", "equivalence")
    result.stdout.fnmatch_lines(["*test_scenario[[]triage-equivalence-fsdp[]]*", "1/* tests collected (* deselected)*"])
    result = pytester.runpytest("--gpuregress", "--collect-only", "-q", "-k", "all_reduce and bf16 and n1024")
    result.stdout.fnmatch_lines(["*test_scenario[[]collectives-all_reduce-sum-bf16-n1024-inplace[]]*",
                                 "*test_scenario[[]collectives-all_reduce-avg-bf16-n1024-inplace[]]*"])
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
    hint = GpuRegressSession(options, pytester.path).places.record_hint("lora")
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
    assert f"--gpuregress-reference-dir={pytester.path / 'reference_runs'} " in own.record_hint("fsdp") + " "
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
    allowed.stdout.fnmatch_lines(["*test_scenario[[]fsdp[]]*"])
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
