"""Known issues: the shipped list, the condition grammar, user files and their error messages."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from pytest_gpuregress.errors import BadKnownIssues
from pytest_gpuregress.stack import known_issues
from pytest_gpuregress.stack.known_issues import (
    COMPONENTS,
    FIELDS,
    HEADER_PREFIX,
    KnownIssue,
    _field_problem,
    header_lines,
    load_known_issues,
    matching,
    parse_known_issues,
    parse_version,
)

REPO = Path(__file__).resolve().parents[2]
CPU_REFERENCE = REPO / "reference_runs" / "fsdp" / "cpu-gloo-w2-fp32" / "record.json"


def gpu_fingerprint(**device: Any) -> dict[str, dict[str, Any]]:
    """A GPU fingerprint as collect() writes it, NCCL backend, no collective variables set."""
    return {
        "versions": {"torch": "2.9.0+rocm7.1", "python": "3.11.7"},
        "device": {"kind": "cuda", "count": 8, "cuda": None, "hip": None, "driver": None, "dnn": None,
                   "blas_library": None, **device},
        "numerics": {"tf32_matmul": False},
        "comm": {"backend": "nccl", "world_size": 8, "nccl_version": "2.26.6", "rccl": False, "env": {}},
    }


def mi350(**device: Any) -> dict[str, dict[str, Any]]:
    fp = gpu_fingerprint(**{"name": "AMD Instinct MI355X", "arch": "gfx950", "hip": "7.1.52802-26aae437f6",
                            "blas_library": "hipBLASLt", **device})
    fp["comm"].update(rccl=True, nccl_version="2.27.7")
    return fp


def mi300x() -> dict[str, dict[str, Any]]:
    return mi350(name="AMD Instinct MI300X", arch="gfx942")


def h100(nccl: str = "2.26.6") -> dict[str, dict[str, Any]]:
    fp = gpu_fingerprint(name="NVIDIA H100 80GB HBM3", arch="sm_90", cuda="12.8", driver="570.124.06",
                         blas_library="cuBLAS", dnn="cuDNN 9.1.0")
    fp["comm"]["nccl_version"] = nccl
    return fp


def cpu_fingerprint() -> dict[str, dict[str, Any]]:
    return json.loads(CPU_REFERENCE.read_text())["fingerprint"]


def ids(issues: list[KnownIssue]) -> set[str]:
    return {issue.id for issue in issues}


@pytest.fixture(scope="module")
def shipped() -> list[KnownIssue]:
    return load_known_issues()


# ---- the shipped list -----------------------------------------------------------------------


def test_the_shipped_file_loads_and_every_entry_is_valid(shipped: list[KnownIssue]) -> None:
    assert len(shipped) >= 5
    assert len(ids(shipped)) == len(shipped)
    for issue in shipped:
        assert issue.component in COMPONENTS
        assert issue.symptom and issue.workaround and issue.source
        assert issue.affects and all(_field_problem(field) is None for field, _ in issue.affects)
        path, line = issue.origin.rsplit(":", 1)
        assert Path(path).read_text().splitlines()[int(line) - 1].strip() == "[[issue]]"


def test_every_field_a_fingerprint_records_can_be_named_in_a_condition() -> None:
    from pytest_gpuregress.stack.fingerprint import collect

    for section, values in collect("cpu", "gloo", 2).items():
        if section == "packages":  # every installed distribution: any name may be named
            assert all(known_issues._field_problem(f"packages.{name}") is None for name in values)
            continue
        for name in values:
            if name != "env" and not name.startswith("determinism."):
                assert name in FIELDS[section], f"{section}.{name} is recorded but not in known_issues.FIELDS"


def test_no_shipped_issue_matches_the_shipped_cpu_reference(shipped: list[KnownIssue]) -> None:
    assert matching(shipped, cpu_fingerprint()) == []


def test_the_rccl_ll_issue_matches_an_mi350_on_rocm_7_1_1_only(shipped: list[KnownIssue]) -> None:
    assert "rccl-ll-allreduce-mi350" in ids(matching(shipped, mi350()))
    assert "rccl-ll-allreduce-mi350" in ids(matching(shipped, mi350(name="AMD Instinct MI350X")))
    assert "rccl-ll-allreduce-mi350" not in ids(matching(shipped, mi300x()))
    assert "rccl-ll-allreduce-mi350" not in ids(matching(shipped, h100()))
    assert "rccl-ll-allreduce-mi350" not in ids(matching(shipped, cpu_fingerprint()))
    gloo = mi350()
    gloo["comm"]["backend"] = "gloo"
    assert "rccl-ll-allreduce-mi350" not in ids(matching(shipped, gloo))


@pytest.mark.parametrize("proto", ["Simple", "^LL", "LL128,Simple"])
def test_a_pinned_protocol_retires_the_rccl_ll_issue(shipped: list[KnownIssue], proto: str) -> None:
    fp = mi350()
    fp["comm"]["env"]["NCCL_PROTO"] = proto
    assert "rccl-ll-allreduce-mi350" not in ids(matching(shipped, fp))


def test_version_bound_issues_match_their_versions_only(shipped: list[KnownIssue]) -> None:
    assert "nccl-2.27.5-bf16-avg-tail" in ids(matching(shipped, h100("2.27.5")))
    assert "nccl-2.27.5-bf16-avg-tail" not in ids(matching(shipped, h100("2.27.6")))
    rccl_same_number = mi350()
    rccl_same_number["comm"]["nccl_version"] = "2.27.5"  # RCCL shares NCCL's numbers: not this bug
    assert "nccl-2.27.5-bf16-avg-tail" not in ids(matching(shipped, rccl_same_number))
    cumem = h100("2.19.3")
    assert "nccl-2.19-cumem-alltoall-hang" in ids(matching(shipped, cumem))
    cumem["comm"]["env"]["NCCL_CUMEM_ENABLE"] = "0"
    assert "nccl-2.19-cumem-alltoall-hang" not in ids(matching(shipped, cumem))
    old_torch = mi300x()
    old_torch["versions"]["torch"] = "2.6.0+rocm6.2.4"
    assert "rocm-hipblaslt-fp16-subnormals" in ids(matching(shipped, mi300x()))
    assert "rocm-hipblaslt-fp16-subnormals" not in ids(matching(shipped, old_torch))


@pytest.mark.parametrize(("torch", "backend", "expected"), [
    ("2.8.0+cu128", "gloo", {"gloo-reduce-scatter-avg-sums", "torch-e4m3fn-overflow-nan"}),  # measured on the CPU
    ("2.9.0+cu128", "gloo", {"torch-e4m3fn-overflow-nan"}),  # measured: 2.9.0 averages
    ("2.9.1+cu128", "gloo", {"torch-e4m3fn-overflow-nan"}),
    ("2.10.0+cu128", "gloo", {"torch-e4m3fn-overflow-nan"}),
    ("2.11.0+cu130", "gloo", {"torch-e4m3fn-overflow-nan"}),  # the GPU machine's torch, on its CPU
    ("2.11.0+cu130", "nccl", {"torch-e4m3fn-overflow-nan"}),
    ("2.8.0+cu128", "nccl", {"torch-e4m3fn-overflow-nan"}),  # NCCL's AVG is its own: not gloo's bug
    ("2.12.1+cu130", "gloo", {"torch-e4m3fn-overflow-nan"}),  # measured: 2.12.1 still gives NaN
    ("2.13.0+cpu", "gloo", set()),
    ("2.14.1+cu130", "gloo", set()),
])
def test_the_issues_found_on_older_torch_match_the_releases_measured(shipped: list[KnownIssue], torch: str, backend: str,
                                                                      expected: set[str]) -> None:
    fp = cpu_fingerprint()
    fp["versions"]["torch"] = torch
    fp["comm"]["backend"] = backend
    assert ids(matching(shipped, fp)) & {"gloo-reduce-scatter-avg-sums", "torch-e4m3fn-overflow-nan"} == expected


def test_a_boolean_condition_matches_the_recorded_flag(shipped: list[KnownIssue]) -> None:
    tf32 = mi300x()
    assert "hipblaslt-tf32-gfx942" not in ids(matching(shipped, tf32))
    tf32["numerics"]["tf32_matmul"] = True
    assert "hipblaslt-tf32-gfx942" in ids(matching(shipped, tf32))


# ---- the condition grammar ------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("2.13.0+cpu", "2.13.0"),
    ("7.1.1-12345", "7.1.1"),
    ("6.4.43482-0f2d60242", "6.4.43482"),
    ("2.8.0a0+gitc1e4d5f", "2.8.0"),
    ("2.9.0.dev20250801+rocm6.4", "2.9.0"),
    ("535.104.05", "535.104.5"),
    ("cuDNN 9.1.0", "9.1.0"),
    (12, "12"),
])
def test_versions_with_build_suffixes_parse(text: object, expected: str) -> None:
    assert parse_version(text) == Version(expected)


@pytest.mark.parametrize("text", [None, True, "", "unknown", "N/A"])
def test_values_without_a_version_give_none(text: object) -> None:
    assert parse_version(text) is None


def issue_on(field: str, condition: Any) -> KnownIssue:
    cond = tuple(condition) if isinstance(condition, list) else condition
    return KnownIssue(id="t", component="kernel", affects=((field, cond),), symptom="s", workaround="w", source="x")


@pytest.mark.parametrize(("field", "condition", "value", "expected"), [
    ("versions.torch", ">=2.13", "2.13.0+cpu", True),
    ("versions.torch", "<2.13", "2.13.0+cpu", False),
    ("versions.torch", ">=2.7", "2.8.0a0+gitc1e4d5f", True),  # a source build is a pre-release
    ("versions.torch", ">=2.7", "2.7.0a0+git1234abc", True),  # ... of 2.7's code: it meets >=2.7
    ("versions.torch", ">=2.7", "not a version", False),
    ("versions.torch", ">=2.7", None, False),
    ("device.hip", "==7.1.*", "7.1.52802-26aae437f6", True),
    ("device.hip", ">=6.4,<6.5", "6.4.43482-0f2d60242", True),
    ("device.hip", ">=7.0", "6.4.43482-0f2d60242", False),
    ("device.driver", "==7.1.1", "7.1.1-12345", True),
    ("comm.nccl_version", "~=2.27.0", "2.27.5", True),
    ("device.dnn", ">=9", "cuDNN 9.1.0", True),
    ("device.name", "*mi35*", "AMD Instinct MI355X", True),
    ("device.name", "*MI35*", "AMD Instinct MI300X", False),
    ("device.arch", "gfx950*", "gfx950:sramecc+:xnack-", True),
    ("device.arch", ["gfx942*", "gfx950*"], "gfx942", True),
    ("device.arch", ["gfx942*", "gfx950*"], "gfx90a", False),
    ("device.arch", "gfx950*", None, False),
    ("device.hip", "set", "7.1.52802", True),
    ("device.hip", "set", None, False),
    ("device.hip", "unset", None, True),
    ("device.hip", "unset", "7.1.52802", False),
    ("numerics.tf32_matmul", True, True, True),
    ("numerics.tf32_matmul", True, "True", False),
    ("comm.world_size", 8, 8, True),
    ("comm.world_size", 8, "8", False),
])
def test_conditions(field: str, condition: Any, value: Any, expected: bool) -> None:
    section, name = field.split(".", 1)
    fp: dict[str, dict[str, Any]] = {section: {name: value}}
    assert issue_on(field, condition).matches(fp) is expected


def test_env_conditions_read_the_recorded_variables() -> None:
    issue = issue_on("comm.env.NCCL_PROTO", "unset")
    assert issue.matches({"comm": {"env": {}}})
    assert issue.matches({})  # no comm section at all: the variable is not set
    assert not issue.matches({"comm": {"env": {"NCCL_PROTO": "Simple"}}})
    assert issue_on("comm.env.NCCL_PROTO", "simple").matches({"comm": {"env": {"NCCL_PROTO": "Simple"}}})


def test_all_conditions_of_an_entry_must_hold() -> None:
    issue = KnownIssue(id="t", component="kernel", affects=(("device.arch", "gfx950*"), ("versions.torch", ">=2.9")),
                       symptom="s", workaround="w", source="x")
    assert issue.matches({"device": {"arch": "gfx950"}, "versions": {"torch": "2.9.1"}})
    assert not issue.matches({"device": {"arch": "gfx950"}, "versions": {"torch": "2.8.0"}})


# ---- user files -----------------------------------------------------------------------------

ENTRY = """\
[[issue]]
id = "{id}"
component = "kernel"
symptom = "{symptom}"
workaround = "set X"
source = "internal bug 12"
[issue.affects]
"device.arch" = "gfx950*"
"""


def test_user_entries_are_added_and_replace_shipped_ones_by_id(tmp_path: Path, shipped: list[KnownIssue]) -> None:
    user = tmp_path / "issues.toml"
    user.write_text(ENTRY.format(id="site-bug", symptom="ours") + "\n"
                    + ENTRY.format(id="rccl-ll-allreduce-mi350", symptom="replaced"))
    issues = load_known_issues(user)
    assert ids(issues) == ids(shipped) | {"site-bug"}
    assert len(issues) == len(shipped) + 1
    replaced = next(i for i in issues if i.id == "rccl-ll-allreduce-mi350")
    assert replaced.symptom == "replaced" and replaced.origin == f"{user}:10"
    assert next(i for i in issues if i.id == "site-bug").origin == f"{user}:1"
    assert "site-bug" in ids(matching(issues, mi350()))


def test_unquoted_dotted_names_and_affects_subtables_are_accepted(tmp_path: Path) -> None:
    text = ('[[issue]]\nid = "a"\ncomponent = "collective"\nsymptom = "s"\nworkaround = "w"\nsource = "x"\n'
            '[issue.affects]\ndevice.arch = "gfx950*"\ncomm.env.NCCL_PROTO = "unset"\n')
    (issue,) = parse_known_issues(text, "f.toml")
    assert dict(issue.affects) == {"device.arch": "gfx950*", "comm.env.NCCL_PROTO": "unset"}


def test_an_empty_user_file_adds_nothing(tmp_path: Path, shipped: list[KnownIssue]) -> None:
    empty = tmp_path / "none.toml"
    empty.write_text("# nothing yet\n")
    assert load_known_issues(empty) == shipped


def test_a_missing_user_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(BadKnownIssues) as err:
        load_known_issues(tmp_path / "nope.toml")
    assert str(tmp_path / "nope.toml") in str(err.value) and "not found" in str(err.value)
    assert "gpuregress_known_issues" in str(err.value)


GOOD = ENTRY.format(id="first", symptom="fine")

# (name, the second entry or the file's tail, what the message says); "# here" marks the line it must name.
MALFORMED = [
    ("toml-syntax", '[[issue]]\nid = "x"\nsymptom = "never closed   # here\n', "not valid TOML"),
    ("missing-key", '[[issue]]   # here\nid = "x"\ncomponent = "kernel"\nsymptom = "s"\nsource = "y"\n'
                    '[issue.affects]\n"device.arch" = "gfx9*"\n', "missing required key 'workaround'"),
    ("unknown-key", ENTRY.format(id="x", symptom="s").replace('source = "internal bug 12"',
                                                               'source = "y"\nsymtpom = "z"   # here'),
     "did you mean 'symptom'"),
    ("unknown-field", ENTRY.format(id="x", symptom="s") + '"device.archh" = "gfx9*"   # here\n',
     "unknown field 'device.archh' (did you mean device.arch?)"),
    ("unknown-section", ENTRY.format(id="x", symptom="s") + '"host.name" = "a*"   # here\n', "unknown field 'host.name'"),
    ("unrecorded-env", ENTRY.format(id="x", symptom="s") + '"comm.env.CUDA_VISIBLE_DEVICES" = "unset"   # here\n',
     "never recorded"),
    ("bad-specifier", ENTRY.format(id="x", symptom="s") + '"versions.torch" = ">=2.x"   # here\n',
     "not a PEP 440 version specifier"),
    ("wrong-type-text", ENTRY.format(id="x", symptom="s").replace('symptom = "s"', "symptom = 3   # here"),
     "'symptom' must be a non-empty string, not an integer"),
    ("wrong-type-condition", ENTRY.format(id="x", symptom="s") + '"versions.torch" = 2.7   # here\n',
     "must be a string, boolean, integer or list, not a number"),
    ("nested-list", ENTRY.format(id="x", symptom="s") + '"device.name" = [["a"]]   # here\n', "nests a list"),
    ("unknown-component", ENTRY.format(id="x", symptom="s").replace('component = "kernel"',
                                                                    'component = "blas"   # here'),
     "unknown component 'blas'"),
    ("empty-affects", ENTRY.format(id="x", symptom="s").replace('[issue.affects]\n"device.arch" = "gfx950*"\n',
                                                                "affects = {}   # here\n"),
     "'affects' must be a non-empty table"),
    ("duplicate-id", ENTRY.format(id="first", symptom="s").replace("[[issue]]", "[[issue]]   # here"),
     "'first' is used twice (first at line 1)"),
]


@pytest.mark.parametrize(("text", "says"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_a_malformed_entry_names_the_file_and_line(tmp_path: Path, text: str, says: str) -> None:
    content = GOOD + "\n" + text
    line = next(n for n, row in enumerate(content.splitlines(), 1) if "# here" in row)
    path = tmp_path / "issues.toml"
    path.write_text(content)
    with pytest.raises(BadKnownIssues) as err:
        load_known_issues(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert says in message and "\n  fix: " in message
    assert err.value.line == line


def test_a_condition_error_in_an_affects_subtable_names_the_entry_too() -> None:
    content = GOOD + "\n" + ENTRY.format(id="second", symptom="s") + '"versions.torch" = ">=x"\n'
    with pytest.raises(BadKnownIssues) as err:
        parse_known_issues(content, "site.toml")
    assert str(err.value).startswith("site.toml:18: known issue 'second' (entry at line 10): ")


def test_an_unknown_top_level_key_is_named() -> None:
    with pytest.raises(BadKnownIssues, match=r"^f\.toml:1: unknown top-level key 'title'"):
        parse_known_issues('title = "mine"\n\n' + GOOD, "f.toml")


def test_an_array_of_non_tables_is_rejected() -> None:
    with pytest.raises(BadKnownIssues, match=r"^f\.toml:1: 'issue' is not an array of tables"):
        parse_known_issues('issue = ["a"]\n', "f.toml")


# ---- the report header ----------------------------------------------------------------------


def test_header_lines_name_id_component_symptom_workaround_and_source(shipped: list[KnownIssue]) -> None:
    assert header_lines([]) == []
    matches = [i for i in matching(shipped, mi350()) if i.id == "rccl-ll-allreduce-mi350"]
    lines = header_lines(matches)
    assert len(lines) == 2 and all(line.startswith(HEADER_PREFIX + " rccl-ll-allreduce-mi350 ") for line in lines)
    assert "(collective, AMD Instinct MI350 series" in lines[0] and "LL-protocol" in lines[0]
    assert "NCCL_PROTO=Simple" in lines[1] and "ROCm 7.1.1" in lines[1] and "ROCm Core SDK 10.1.0" in lines[1]
    assert all("\n" not in line and "  " not in line for line in lines)  # multi-line TOML strings are joined


def test_matching_does_not_change_the_fingerprint(shipped: list[KnownIssue]) -> None:
    fp = mi350()
    before = copy.deepcopy(fp)
    matching(shipped, fp)
    assert fp == before


def test_the_documented_example_file_parses() -> None:
    doc = (REPO / "docs" / "known_issues.md").read_text()
    example = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    issues = parse_known_issues(example, "docs/known_issues.md")
    assert [i.id for i in issues] == ["site-ib-firmware-hang", "fp8-flavour-mi300-mi350"]
