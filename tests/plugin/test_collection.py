"""What ``pytest --gpuregress`` collects (plugin/collection.py): the ``gpuregress[::case]`` arguments taken off
pytest's, the cases they name, and the header's word on a suite left out. Pure functions; no rank starts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from pytest_gpuregress.plugin.collection import (
    ROOT,
    BuiltinRequest,
    builtin_node_id,
    header_line,
    take_builtin_arguments,
    typed_node_id,
    unknown_cases,
    wanted,
)


def fake_config(root: Path, args: list[str], *, invoked_in: Path | None = None) -> SimpleNamespace:
    """What take_builtin_arguments reads of a pytest.Config: the arguments, the folder pytest runs in, its rootdir,
    and the paths the user gave (``args`` as given: pytest's testpaths are not among them)."""
    return SimpleNamespace(args=list(args), invocation_params=SimpleNamespace(dir=invoked_in or root), rootpath=root,
                           option=SimpleNamespace(file_or_dir=list(args)))


def test_the_builtin_arguments_are_taken_off_pytests_and_name_their_cases(tmp_path: Path) -> None:
    """``gpuregress::<case>`` arguments leave pytest's list (no such file exists) and become the cases' patterns;
    a bare ``gpuregress`` among them means every case."""
    config = fake_config(tmp_path, ["tests/test_mine.py", "gpuregress::fsdp*", "gpuregress::lora-none"])
    request = take_builtin_arguments(config, leave_out=False)
    assert request == BuiltinRequest(True, frozenset({"fsdp*", "lora-none"}))
    assert config.args == ["tests/test_mine.py"]
    every = take_builtin_arguments(fake_config(tmp_path, ["gpuregress", "gpuregress::fsdp"]), leave_out=True)
    assert (every.wanted, every.only) == (True, None)  # named, so --gpuregress-no-builtin does not leave it out


def test_from_a_folder_below_the_rootdir_the_suite_is_named_as_pytest_shows_it(tmp_path: Path) -> None:
    """``../gpuregress::fsdp`` typed in ``<rootdir>/tests`` names the suite, as pytest prints node ids from there."""
    below = tmp_path / "tests"
    below.mkdir()
    config = fake_config(tmp_path, ["../gpuregress::fsdp"], invoked_in=below)
    assert take_builtin_arguments(config, leave_out=False).only == frozenset({"fsdp"})
    assert config.args == []


def test_a_users_own_file_or_folder_named_gpuregress_stays_a_path(tmp_path: Path) -> None:
    """A folder of the project called ``gpuregress`` is the user's: it stays among pytest's paths, and those paths
    narrow collection, so the suite is left out with the reason."""
    (tmp_path / ROOT).mkdir()
    config = fake_config(tmp_path, [ROOT])
    request = take_builtin_arguments(config, leave_out=False)
    assert config.args == [ROOT]
    assert not request.wanted and "(gpuregress)" in request.left_out_by
    assert header_line(request) == [f"gpuregress built-in cases: not collected: {request.left_out_by}"]


def test_without_paths_the_suite_joins_unless_left_out(tmp_path: Path) -> None:
    """No paths given: every case, or none with --gpuregress-no-builtin, which the header then names."""
    assert take_builtin_arguments(fake_config(tmp_path, []), leave_out=False) == BuiltinRequest(True, None, "")
    left_out = take_builtin_arguments(fake_config(tmp_path, []), leave_out=True)
    assert left_out == BuiltinRequest(False, None, "--gpuregress-no-builtin")
    assert header_line(left_out) == ["gpuregress built-in cases: not collected: --gpuregress-no-builtin"]
    assert header_line(BuiltinRequest(True)) == []


def test_patterns_select_cases_and_unknown_ones_are_a_usage_error() -> None:
    """Patterns match test ids with fnmatch; a pattern matching no known case is named in the usage error, with
    the node id a user types, and a request without patterns has nothing unknown."""
    request = BuiltinRequest(True, frozenset({"fsdp*", "lora-none", "no-such-case"}))
    assert [c for c in ("fsdp", "fsdp-bf16", "lora-none", "lora-fully_shard") if wanted(request, c)] == \
        ["fsdp", "fsdp-bf16", "lora-none"]
    assert wanted(BuiltinRequest(True), "anything")
    message = unknown_cases(request, {"fsdp", "fsdp-bf16", "lora-none"})
    assert message is not None and message.startswith(f"no built-in case {builtin_node_id('no-such-case')} ")
    assert "fsdp" not in message.split(" in this configuration")[0]  # only the unknown pattern is named
    assert unknown_cases(request, {"fsdp", "lora-none", "no-such-case"}) is None
    assert unknown_cases(BuiltinRequest(True), set()) is None


def test_a_node_id_is_printed_from_where_pytest_runs(tmp_path: Path) -> None:
    """A project's test's node id is given relative to the invocation folder (pytest's start at the rootdir); a
    built-in case's is its own."""
    below = tmp_path / "tests"
    config = SimpleNamespace(invocation_params=SimpleNamespace(dir=below))
    mine = SimpleNamespace(nodeid="tests/test_mine.py::test_a[x]", path=below / "test_mine.py", config=config)
    assert typed_node_id(mine) == "test_mine.py::test_a[x]"  # type: ignore[arg-type]
    case = SimpleNamespace(nodeid=builtin_node_id("fsdp-bf16"), path=tmp_path, config=config)
    assert typed_node_id(case) == "gpuregress::fsdp-bf16"  # type: ignore[arg-type]
    assert builtin_node_id("fsdp-bf16") == f"{ROOT}::fsdp-bf16"

