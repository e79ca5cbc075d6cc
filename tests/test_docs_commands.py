"""Docs that cannot drift: every ``pytest`` and ``gpuregress`` command shown in README.md, docs/ and the CI
recipes of examples/ci/ uses options that exist, and the recipes parse and do what docs/ci.md promises."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "examples" / "ci"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SEPARATORS = re.compile(r"&&|\|\||;|\|")


def _help(*command: str) -> str:
    done = subprocess.run([sys.executable, "-m", *command, "--help"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@functools.cache
def pytest_options() -> frozenset[str]:
    """Every long option of ``pytest --gpuregress --help``, hyphens dropped: pytest takes --junitxml and shows
    --junit-xml."""
    shown = re.findall(r"(--[a-z][a-z0-9-]*)", _help("pytest", "-p", "no:cacheprovider", "--gpuregress"))
    return frozenset(_plain(o) for o in shown)


def _plain(option: str) -> str:
    return "--" + option[2:].replace("-", "")


@functools.cache
def cli_options(subcommand: str) -> frozenset[str] | None:
    """The options of ``gpuregress <subcommand>``; None when there is no such subcommand."""
    runner = "import sys; from pytest_gpuregress.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", runner, subcommand, "--help"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    if done.returncode != 0:
        return None
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", done.stdout))


def commands_in(text: str) -> Iterator[str]:
    """Every command line starting with pytest or gpuregress: in shell lines (continuations joined), after a
    ``$`` prompt, in inline code spans, and after ``&&`` or ``;``."""
    joined = re.sub(r"\\\n\s*", " ", text)
    spans = re.findall(r"`([^`\n]+)`", joined)
    for piece in [*joined.splitlines(), *spans]:
        for part in SEPARATORS.split(piece):
            part = part.strip().removeprefix("$ ").strip()
            if not re.match(r"(python -m )?(pytest|gpuregress)( |$)", part) or _output_line(part, piece in spans):
                continue
            yield part


def _output_line(part: str, inline: bool) -> bool:
    """A line the plugin prints ("gpuregress regression: ...", "gpuregress KNOWN ISSUE ...", "gpuregress lora
    targets (m): ..."), or an inline mention of one ("the `gpuregress determinism` line"): not a command."""
    if part.startswith("pytest") or part.startswith("python"):
        return False
    if re.match(r"gpuregress [\w-]+( [\w-]+)*( \([^)]*\))?:", part) or re.match(r"gpuregress [A-Z]", part):
        return True
    return inline and "--" not in part and cli_options(part.split()[1]) is None if len(part.split()) > 1 else False


def yaml_commands(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for value in node.values():
            yield from yaml_commands(value)
    elif isinstance(node, list):
        for value in node:
            yield from yaml_commands(value)
    elif isinstance(node, str):
        yield from commands_in(node)


def unknown_options(command: str) -> list[str]:
    try:
        words = shlex.split(command.replace("${", "{").replace("$", ""))
    except ValueError:
        words = command.split()
    if words[:2] == ["python", "-m"]:
        words = words[2:]
    options = [w.split("=", 1)[0] for w in words[1:] if w.startswith("--")]
    if words[0] == "pytest":
        return [o for o in options if _plain(o) not in pytest_options()]
    subcommand = next((w for w in words[1:] if not w.startswith("-")), None)
    if subcommand is None or subcommand.startswith(("<", "{")):
        return []
    known = cli_options(subcommand)
    if known is None:
        return [f"subcommand {subcommand!r}"]
    return [o for o in options if o not in known]


def all_commands() -> list[tuple[str, str]]:
    found = [(str(path.relative_to(REPO)), c) for path in DOCS for c in commands_in(path.read_text())]
    for path in sorted(RECIPES.iterdir()):
        text = path.read_text()
        commands = yaml_commands(yaml.safe_load(text)) if path.suffix in (".yml", ".yaml") else commands_in(text)
        found += [(str(path.relative_to(REPO)), c) for c in commands]
    return found


def test_every_command_shown_uses_options_that_exist() -> None:
    found = all_commands()
    assert len(found) > 20  # the README, the docs and the recipes show many
    wrong = {f"{where}: {command}": bad for where, command in found if (bad := unknown_options(command))}
    assert not wrong, wrong


def test_the_checker_catches_an_option_that_does_not_exist() -> None:
    assert unknown_options("pytest --gpuregress --gpuregress-record-always -k fsdp") == ["--gpuregress-record-always"]
    assert unknown_options("gpuregress compare --no-such-flag a b") == ["--no-such-flag"]
    assert unknown_options("gpuregress frobnicate x") == ["subcommand 'frobnicate'"]
    assert sorted(commands_in("run `pytest --gpuregress -k fsdp` then\n$ gpuregress show refs")) == [
        "gpuregress show refs", "pytest --gpuregress -k fsdp"]


@pytest.mark.parametrize("recipe", ["github-actions.yml", "gitlab-ci.yml", "slurm.sbatch"])
def test_each_ci_recipe_records_compares_keeps_artifacts_and_fails_on_a_regression(recipe: str) -> None:
    text = (RECIPES / recipe).read_text()
    if recipe.endswith(".yml"):
        yaml.safe_load(text)  # it parses
    commands = list(yaml_commands(yaml.safe_load(text))) if recipe.endswith(".yml") else list(commands_in(text))
    compare = [c for c in commands if "--gpuregress-record" not in c and c.startswith("pytest --gpuregress")]
    record = [c for c in commands if "--gpuregress-record" in c]
    assert compare and record, commands
    for command in compare:  # references kept in the repository; artifacts and JUnit for the upload
        assert "--gpuregress-reference-dir=gpu-references" in command
        assert "--gpuregress-artifacts=" in command and "--junitxml=" in command
    assert "|| true" not in text and "continue-on-error" not in text  # a regression fails the pipeline
    if recipe == "github-actions.yml":
        steps = yaml.safe_load(text)["jobs"]["gpuregress"]["steps"]
        upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
        assert upload["if"] == "${{ always() }}" and "gpuregress.xml" in upload["with"]["path"]
    if recipe == "gitlab-ci.yml":
        job = yaml.safe_load(text)["gpuregress"]
        assert job["artifacts"]["when"] == "always" and job["artifacts"]["reports"]["junit"] == "gpuregress.xml"
    if recipe == "slurm.sbatch":
        assert text.startswith("#!/bin/bash") and "set -euo pipefail" in text


def test_docs_ci_shows_each_recipe() -> None:
    text = (REPO / "docs" / "ci.md").read_text()
    for recipe in sorted(RECIPES.iterdir()):
        assert f"examples/ci/{recipe.name}" in text


def test_the_options_tables_are_the_declarations() -> None:
    """docs/options.md's tables are generated from the declarations (plugin/options.py, option_spec.py): a
    new, changed or removed option changes them, word for word."""
    from pytest_gpuregress.plugin.options_doc import BEGIN, END, options_markdown

    text = (REPO / "docs" / "options.md").read_text()
    assert BEGIN in text and END in text, "docs/options.md lost the markers of its generated block"
    block = text[text.index(BEGIN):text.index(END) + len(END)] + "\n"
    assert block == options_markdown(), \
        "docs/options.md is out of date: run python -m pytest_gpuregress.plugin.options_doc docs/options.md"


def test_every_declared_option_is_on_the_command_line_and_an_ini_key() -> None:
    from pytest_gpuregress.plugin.options import BUILTIN_SCENARIO_OPTIONS, CORE_OPTIONS

    declared = [*CORE_OPTIONS, *BUILTIN_SCENARIO_OPTIONS]
    assert len({spec.flag for spec in declared}) == len(declared)  # no option declared twice
    assert {_plain(spec.flag) for spec in declared} <= pytest_options()
    shown = _help("pytest", "-p", "no:cacheprovider")  # ini keys are declared with or without the flag
    assert [spec.ini_key for spec in declared if f"  {spec.ini_key} " not in shown] == []


def test_the_readme_is_short_and_every_link_in_the_docs_resolves() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(REPO)} -> {target}")
    assert not broken, broken
