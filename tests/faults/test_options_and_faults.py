"""Option values and fault specs are validated once, at configure time: a one-line usage error, no rank started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytest_gpuregress.errors import BadFaultSpec
from pytest_gpuregress.faults import parse


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("--gpuregress-steps=abc", "--gpuregress-steps 'abc': expected an integer such as 300"),
        ("--gpuregress-steps=0", "--gpuregress-steps '0': must be at least 1"),
        ("--gpuregress-world-size=0", "--gpuregress-world-size '0': must be at least 1"),
        ("--gpuregress-timeout=soon", "--gpuregress-timeout 'soon': expected a number such as 600"),
        ("--gpuregress-collectives-max-bytes=lots", "--gpuregress-collectives-max-bytes 'lots': expected a size such as 4MiB"),
        ("--gpuregress-collectives-max-bytes=0", "--gpuregress-collectives-max-bytes '0': must be at least 1"),
        ("--gpuregress-collectives-repeats=0", "--gpuregress-collectives-repeats '0': must be at least 1"),
        ("--gpuregress-lane=fuzzy", "--gpuregress-lane 'fuzzy': must be one of auto, exact, tolerant"),
        ("--gpuregress-inject=colective:op=all_reduce", "unknown fault kind 'colective'; known kinds: collective, "),
        ("--gpuregress-inject=collective:opp=all_reduce", "fault kind 'collective' has no key 'opp'; its keys: op, mode,"),
        ("--gpuregress-inject=collective:op=allreduce", "op='allreduce' is not allowed; op takes one of all_reduce|"),
        ("--gpuregress-inject=collective:mode=flip", "mode='flip' is not allowed; mode takes one of nudge|zero_tail"),
        ("--gpuregress-inject=collective:dtype=bf17", "dtype='bf17' is not allowed; dtype takes one of bf16, "),
        ("--gpuregress-inject=collective:rel=big", "rel='big' is not allowed; rel takes a number"),
        ("--gpuregress-inject=lr_scale:1.01", "'1.01' is not key=value"),
        ("--gpuregress-inject=collective:mode=zero_tail,count=0",
         "count='0' is not allowed; count takes an integer of at least 1"),
        ("--gpuregress-inject=collective:mode=stale_chunk,pieces=1",
         "pieces='1' is not allowed; pieces takes an integer of at least 2"),
        ("--gpuregress-inject=collective:every=0", "every='0' is not allowed"),
        ("--gpuregress-inject=crash:rank=-1", "rank='-1' is not allowed"),
        ("--gpuregress-inject=hang:rank=5", "names rank 5, but this run has ranks 0 to 1"),
    ],
)
def test_bad_values_are_one_line_usage_errors_before_any_rank_starts(
    pytester: pytest.Pytester, argument: str, message: str
) -> None:
    result = pytester.runpytest("--gpuregress", argument)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.startswith("ERROR:")]
    assert len(errors) == 1 and message in errors[0], result.stderr.str()
    assert "Traceback" not in result.stderr.str() and "INTERNALERROR" not in result.stderr.str()
    assert not list(pytester.path.rglob("gpuregress-run-*"))  # no rank was started


def test_bad_ini_value_names_the_ini_key(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpuregress_steps = many\n")
    result = pytester.runpytest("--gpuregress")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini key gpuregress_steps = 'many': expected an integer*"])


def test_without_the_flag_bad_values_are_not_read(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_ok():\n    pass\n")
    pytester.runpytest("--gpuregress-steps=abc").assert_outcomes(passed=1)


# A plug-in scenario with an option of its own, declared with the neutral OptionSpec (no import of the plugin);
# its case id shows the value the scenario was given.
SIZED_PLUG_IN = """
from pytest_gpuregress.option_spec import OptionSpec
from pytest_gpuregress.scenarios import Scenario
from pytest_gpuregress.scenarios.base import Case


class Sized(Scenario):
    name = "sized"
    rank_entry = "sized:train"
    options = (OptionSpec("sized-count", "int", 4, "how many of it", minimum=1),)

    def cases(self, setup):
        return [Case(f"count{setup.option('sized-count')}")]


SCENARIO = Sized()
"""


@pytest.mark.full_tier  # 25 s: a plug-in's session end to end: the fast tier stays within its time
def test_a_plug_ins_option_exists_with_the_flag_is_checked_and_reaches_the_scenario(pytester: pytest.Pytester) -> None:
    from ..scenarios.test_scenario_plugins import install_entry_point

    pytester.makepyfile(sized=SIZED_PLUG_IN)
    install_entry_point(pytester, "sized", "sized:SCENARIO", dist="sized_pkg")
    run = pytester.runpytest_subprocess
    assert "--gpuregress-sized-count" not in run("-p", "no:cacheprovider", "--help").stdout.str()  # not imported
    run("-p", "no:cacheprovider", "--gpuregress", "--help").stdout.fnmatch_lines(
        ["*--gpuregress-sized-count=INT*", "*how many of it (default: 4)*"])
    result = run("-p", "no:cacheprovider", "--gpuregress", "--collect-only", "-q", "-k", "sized",
                 "--gpuregress-sized-count=7")
    result.stdout.fnmatch_lines(["gpuregress::sized-count7"])
    refused = run("-p", "no:cacheprovider", "--gpuregress", "--collect-only", "--gpuregress-sized-count=0")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["ERROR: --gpuregress-sized-count '0': must be at least 1"])


def test_a_mistyped_declaration_fails_where_it_is_written() -> None:
    from pytest_gpuregress.option_spec import OptionSpec

    with pytest.raises(ValueError, match="--gpuregress-x: kind 'integer' is not one of flag, str, path"):
        OptionSpec("x", "integer", 1, "an x")
    with pytest.raises(ValueError, match="--gpuregress-y: a choice option, and only one, lists its choices"):
        OptionSpec("y", "choice", "a", "a y")


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16"])
def test_dtype_filters_take_short_and_torch_names(spelling: str) -> None:
    assert parse(f"collective:dtype={spelling}").get("dtype") == "bfloat16"


def test_fault_values_are_typed() -> None:
    spec = parse("collective:op=all_reduce|reduce_scatter,rel=1e-4,count=3,ranks=0|1,every=20")
    assert spec.get("op") == {"all_reduce", "reduce_scatter"}
    assert spec.get("rel") == 1e-4 and spec.get("count") == 3 and spec.get("every") == 20
    assert spec.ranks == {0, 1}


def test_a_required_key_is_asked_for_at_configure_time() -> None:
    with pytest.raises(BadFaultSpec, match="fault kind 'format' needs mode= \\(mode takes one of fn_as_fnuz"):
        parse("format:format=e4m3fn")


def test_a_kind_without_keys_refuses_every_key() -> None:
    with pytest.raises(BadFaultSpec, match="has no key 'x'; its keys: none"):
        parse("emulate_premul_sum:x=1")


def test_two_stacked_collective_faults_both_fire_and_are_counted() -> None:
    """Each fault keeps its own 'inside a wrapped call' state: the outer one no longer makes the inner one pass
    through, and a collective implemented through another is still corrupted once per fault."""
    from types import SimpleNamespace

    import torch

    from pytest_gpuregress.faults.collective import CollectiveFault, _wrap_collective

    def all_reduce(tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False) -> None:
        return None  # a stand-in for the transport: the output is left as the input

    def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, **kwargs: object) -> None:
        dist.all_reduce(output_tensor)  # a collective implemented through another

    dist = SimpleNamespace(all_reduce=all_reduce, all_gather_into_tensor=all_gather_into_tensor)
    tail = CollectiveFault(parse("collective:op=all_reduce,mode=zero_tail,count=1"), rank=0, world_size=2)
    nudge = CollectiveFault(parse("collective:op=all_reduce,mode=nudge,rel=0.5"), rank=0, world_size=2)
    undo = [_wrap_collective(dist, "all_reduce", tail), _wrap_collective(dist, "all_reduce", nudge)]
    tensor = torch.ones(8)
    dist.all_reduce(tensor)
    assert tensor.tolist() == [1, 1, 1, 1, 1.5, 1, 1, 0]  # both fired on the one call
    assert (tail.fired, nudge.fired) == (1, 1)
    gather = CollectiveFault(parse("collective:op=all_gather,mode=zeros"), rank=0, world_size=2)
    undo.append(_wrap_collective(dist, "all_gather_into_tensor", gather))
    out = torch.ones(4)
    dist.all_gather_into_tensor(out, torch.ones(2))
    assert (gather.fired, tail.fired, nudge.fired) == (1, 2, 2) and out.tolist() == [0, 0, 0, 0]
    for restore in reversed(undo):
        restore()
    assert dist.all_reduce is all_reduce


def test_the_plugins_own_collectives_are_never_a_faults_target() -> None:
    """The bandwidth probe and fail-fast's vote are the plugin's: a fault matching only them must count 0 firings."""
    from types import SimpleNamespace

    import torch

    from pytest_gpuregress.fault_points import plugin_own_collectives
    from pytest_gpuregress.faults.collective import CollectiveFault, _wrap_collective

    dist = SimpleNamespace(all_reduce=lambda tensor, op=None, group=None, async_op=False: None)
    fault = CollectiveFault(parse("collective:op=all_reduce,mode=zeros"), rank=0, world_size=2)
    undo = _wrap_collective(dist, "all_reduce", fault)
    probe = torch.ones(4)
    with plugin_own_collectives():
        dist.all_reduce(probe)
    assert probe.tolist() == [1, 1, 1, 1] and fault.fired == 0
    dist.all_reduce(probe)  # the training's own call still is
    assert probe.tolist() == [0, 0, 0, 0] and fault.fired == 1
    undo()


def test_linear_noise_that_rounds_away_in_the_dtype_does_not_count_as_fired() -> None:
    import torch
    import torch.nn.functional as F

    from pytest_gpuregress.faults.training import install_linear_noise

    ctx = SimpleNamespace(cleanup_hooks=[])
    firing = install_linear_noise(parse("linear_noise:rel=1e-7"), ctx)
    try:
        weight = torch.ones(4, 4)
        assert torch.equal(F.linear(torch.ones(2, 4, dtype=torch.bfloat16), weight.bfloat16()), torch.full((2, 4), 4.0,
                                                                                                            dtype=torch.bfloat16))
        assert firing.count == 0  # 1 +- 1e-7 is exactly 1 in bf16: nothing changed
        assert not torch.equal(F.linear(torch.ones(2, 4), weight), torch.full((2, 4), 4.0))
        assert firing.count == 1
    finally:
        for undo in ctx.cleanup_hooks:
            undo()
