"""Names that become path components: one rule, one clear error, nothing written outside the reference dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_gpuregress.errors import GpuRegressError, UnsafeName
from pytest_gpuregress.reference import store
from pytest_gpuregress.reference.names import safe_component
from pytest_gpuregress.scenarios.base import Setup
from pytest_gpuregress.scenarios.collectives import CollectivesScenario

from ..conftest import make_record


@pytest.mark.parametrize("name", ["cpu-gloo-w2-fp32", "cuda-sm90-nccl-w8-bf16", "cuda-sm_90-nccl-w8-bf16", "lora",
                                  "LL128+Ring", "fsdp", "v1.2", "x"])
def test_typical_names_are_accepted(name: str) -> None:
    assert safe_component(name, "platform key") == name


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "", "x y", "/abs", "a\\b", ".hidden", "x\n", "é", None, 3])
def test_unsafe_names_are_refused_naming_the_value_and_where_it_came_from(name: object) -> None:
    where = "reference name (the name= given to gpuregress.check())"
    with pytest.raises(UnsafeName) as info:
        safe_component(name, where)
    message = str(info.value)
    assert isinstance(info.value, GpuRegressError)  # the plugin shows these as one line, without a traceback
    assert f"{where} {name!r}" in message
    assert "use only letters, digits" in message and "\n" not in message


@pytest.mark.parametrize(("scenario", "platform_key"), [("../x", "cpu-gloo-w2-fp32"), ("fsdp", "cpu-gloo-w2-../../x")])
def test_store_writes_nothing_for_an_unsafe_location(tmp_path: Path, scenario: str, platform_key: str) -> None:
    root = tmp_path / "refs"
    with pytest.raises(UnsafeName):
        store.write_reference(store.ReferenceLocation(root, scenario, platform_key), make_record(), overwrite=True)
    assert list(tmp_path.iterdir()) == []


def test_collective_protocol_labels_are_checked_before_they_name_a_folder() -> None:
    setup = Setup("cuda", "nccl", 2, options={"gpuregress_nccl_protos": ["../x"], "gpuregress_collectives_max_bytes": 64})
    scenario = CollectivesScenario()
    with pytest.raises(UnsafeName, match=r"NCCL protocol group .*--gpuregress-nccl-protos.* '\.\./x'"):
        scenario.launches(scenario.cases(setup), setup)


USER_TEST = '''
import pytest

from pytest_gpuregress.reference.record import RunRecord


@pytest.mark.parametrize(("name", "platform_key"), [("../x", "cpu-gloo-w2-fp32"), ("mine", "cpu-gloo-w2-../../x")])
def test_unsafe(gpuregress, name, platform_key):
    record = RunRecord(scenario="mine", config={"steps": 1}, platform_key=platform_key, world_size=2,
                       series={"loss": [1.0]})
    gpuregress.check(record, name=name)
'''


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.parametrize("mode", ["--gpuregress-record", "--gpuregress-lane=auto"], ids=["record", "compare"])
def test_unsafe_name_through_the_fixture_is_one_clear_error_and_writes_nothing(pytester: pytest.Pytester,
                                                                                 mode: str) -> None:
    pytester.makepyfile(test_user=USER_TEST)
    refs = pytester.path / "refs" / "inner"
    if mode != "--gpuregress-record":  # a comparing run needs its folder to exist (a usage error otherwise)
        refs.mkdir(parents=True)
    before = files_under(pytester.path)
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={refs}",
                                "-k", "test_unsafe", mode, "test_user.py")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*gpuregress UnsafeName: reference name (the name= given to gpuregress.check()*) '../x' cannot be a folder*",
        "*gpuregress UnsafeName: platform key (*dtype) 'cpu-gloo-w2-../../x' cannot be a folder*",
    ])
    output = result.stdout.str()
    assert "Traceback" not in output and "raise UnsafeName" not in output
    assert files_under(pytester.path) == before  # nothing written: not in refs/, not beside it
