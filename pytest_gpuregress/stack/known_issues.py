"""Known bugs of ML training stacks, matched against a run's fingerprint.

The shipped ``known_issues.toml`` plus a user's file (ini ``gpuregress_known_issues``), which adds entries or
replaces one by id. All of an entry's conditions must hold; the schema and condition grammar (versions, set /
unset, globs, ``comm.env.NAME``): docs/known_issues.md.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..components import COMPONENTS
from ..errors import BadKnownIssues
from .fingerprint import Fingerprint, lookup
from .fingerprint_fields import COMM_ENV_PREFIXES, MATCHABLE, PREFIXED, recorded_env

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pytest itself depends on tomli below 3.11
    import tomli as tomllib

SHIPPED_FILE = "known_issues.toml"
HEADER_PREFIX = "gpuregress KNOWN ISSUE"

REQUIRED_KEYS = ("id", "component", "affects", "symptom", "workaround", "source")
OPTIONAL_KEYS = ("hardware",)
_TEXT_KEYS = ("id", "component", "symptom", "workaround", "source", "hardware")

# Every field collect() records, so that a misspelt condition is an error and not a silent no-match.
# comm.env.NAME and numerics.determinism.NAME are checked separately.
FIELDS: dict[str, frozenset[str]] = MATCHABLE

_SPECIFIER_START = ("<", ">", "=", "!", "~")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ENTRY_HEADER = re.compile(r"^\s*\[\[\s*issue\s*\]\]")

Condition = str | bool | int | tuple[str | bool | int, ...]


@dataclass(frozen=True)
class KnownIssue:
    """One known bug. ``affects`` holds (section.field, condition) pairs; lists are tuples."""

    id: str
    component: str
    affects: tuple[tuple[str, Condition], ...]
    symptom: str
    workaround: str
    source: str
    hardware: str = ""
    origin: str = ""  # file:line of the entry's [[issue]] header

    def matches(self, fingerprint: Fingerprint) -> bool:
        return all(_holds(cond, lookup(fingerprint, field)) for field, cond in self.affects)



def parse_version(value: object) -> Version | None:
    """A comparable version from what tools report, or None: everything from the first ``+``, ``-`` or blank
    is dropped (``7.1.1-12345`` would be a PEP 440 post-release), as are pre- and dev-release markers
    (``2.8.0a0`` -> 2.8.0); a name in front (``cuDNN 9.1.0``) gives its first dotted number.
    """
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    head = re.split(r"[+\-\s]", text, maxsplit=1)[0]
    try:
        parsed = Version(head)
    except InvalidVersion:
        found = re.search(r"\d+(?:\.\d+)*", text)
        return Version(found.group()) if found else None
    # The release only: a source build or nightly of 2.7 (2.7.0a0+git..., 2.7.0.dev2025...) has 2.7's code,
    # and must meet ">=2.7" as 2.7.0 does (PEP 440 would order it before 2.7).
    return Version(".".join(str(part) for part in parsed.release))


def _holds(cond: Condition, actual: Any) -> bool:
    if isinstance(cond, tuple):
        return any(_holds(c, actual) for c in cond)
    if isinstance(cond, bool | int):  # true/false match only booleans, an integer only a number that is not one
        return isinstance(actual, bool) == isinstance(cond, bool) and actual == cond
    if cond in ("set", "unset"):
        return (actual is None) == (cond == "unset")
    if actual is None:
        return False
    if cond.startswith(_SPECIFIER_START):
        version = parse_version(actual)
        return version is not None and SpecifierSet(cond).contains(version, prereleases=True)
    return fnmatch.fnmatchcase(str(actual).lower(), cond.lower())


def matching(issues: Iterable[KnownIssue], fingerprint: Fingerprint) -> list[KnownIssue]:
    """The issues whose conditions all hold for this fingerprint, in file order."""
    return [issue for issue in issues if issue.matches(fingerprint)]


def header_lines(matches: Iterable[KnownIssue]) -> list[str]:
    """Two lines per matching issue for the pytest report header; [] when none match."""
    out: list[str] = []
    for issue in matches:
        where = f", {issue.hardware}" if issue.hardware else ""
        out.append(f"{HEADER_PREFIX} {issue.id} ({issue.component}{where}): {issue.symptom}")
        out.append(f"{HEADER_PREFIX} {issue.id} workaround: {issue.workaround} [source: {issue.source}]")
    return out


def cited_lines(issues: Iterable[KnownIssue]) -> list[str]:
    """What a failed case says of each known issue of a component it names: the entry, its source and its fix."""
    return [f"this failure names the {issue.component}, and {issue.id} is a known {issue.component} issue of this "
            f"stack: {issue.symptom} [source: {issue.source}]; workaround: {issue.workaround}" for issue in issues]



def load_known_issues(user_file: Path | str | None = None) -> list[KnownIssue]:
    """The shipped entries plus the user's; a user entry replaces a shipped one with the same id."""
    shipped = resources.files("pytest_gpuregress.stack") / SHIPPED_FILE
    issues = parse_known_issues(shipped.read_text(encoding="utf-8"), str(shipped))
    if user_file is None:
        return issues
    path = Path(user_file)
    user = parse_known_issues(_read_user_file(path), str(path))
    replaced = {issue.id for issue in user}
    return [issue for issue in issues if issue.id not in replaced] + user


def _read_user_file(path: Path) -> str:
    fix = "point the gpuregress_known_issues ini setting at an existing TOML file (schema: docs/known_issues.md)"
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadKnownIssues(path, None, "known-issues file not found", fix) from None
    except UnicodeDecodeError as exc:
        raise BadKnownIssues(path, None, f"not UTF-8 text ({exc.reason})", "save the file as UTF-8") from None
    except OSError as exc:
        raise BadKnownIssues(path, None, f"cannot read the known-issues file: {exc.strerror}", fix) from None


def parse_known_issues(text: str, path: str) -> list[KnownIssue]:
    """Parse and validate one known-issues file; ``path`` names it in errors."""
    lines = text.splitlines()
    entries = _entries(text, lines, path)
    issues: list[KnownIssue] = []
    seen: dict[str, int] = {}
    for n, (entry, (start, end)) in enumerate(zip(entries, _entry_lines(lines, len(entries)))):
        issue = _Entry(path, lines, start, end, n).parse(entry)
        if issue.id in seen:
            raise BadKnownIssues(path, start, f"known issue id {issue.id!r} is used twice (first at line {seen[issue.id]})",
                                 "give each entry its own id")
        seen[issue.id] = start
        issues.append(issue)
    return issues


def _entry_lines(lines: list[str], count: int) -> list[tuple[int, int]]:
    """Each entry's [start, end) lines: from its [[issue]] header to the next one, or to the file's end."""
    starts = [n for n, line in enumerate(lines, 1) if _ENTRY_HEADER.match(line)]
    if len(starts) != count:  # the inline form, issue = [{...}], has no headers
        starts = [_key_line(lines, "issue") or 1] * count
    ends = [after if after > start else len(lines) + 1 for start, after in zip(starts, [*starts[1:], len(lines) + 1])]
    return list(zip(starts, ends))


def _entries(text: str, lines: list[str], path: str) -> list[dict[str, Any]]:
    """The file's [[issue]] tables; an error for anything else at the top level."""
    data = _load_toml(text, path)
    for key in data:
        if key != "issue":
            raise BadKnownIssues(path, _key_line(lines, key) or None, f"unknown top-level key {key!r}",
                                 "put every entry under its own [[issue]] header; nothing else belongs at the top level")
    entries = data.get("issue", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise BadKnownIssues(path, _key_line(lines, "issue") or None, "'issue' is not an array of tables",
                             "start each entry with a [[issue]] line (two brackets)")
    return entries


def _load_toml(text: str, path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"at line (\d+)", str(exc))
        raise BadKnownIssues(
            path, int(found.group(1)) if found else None, f"not valid TOML: {exc}",
            "correct the TOML syntax there: strings in double quotes, dotted condition names quoted "
            "(\"device.arch\" = \"gfx950*\"), one [[issue]] header per entry",
        ) from None


def _key_line(lines: list[str], key: str, start: int = 1, end: int | None = None) -> int:
    """The line (1-based) of ``key =`` within [start, end), trying the full key then its last part; 0 if absent."""
    last = len(lines) + 1 if end is None else min(end, len(lines) + 1)
    for name in dict.fromkeys([key, key.rsplit(".", 1)[-1]]):
        pattern = re.compile(rf"""^\s*(?:"{re.escape(name)}"|'{re.escape(name)}'|{re.escape(name)})\s*=""")
        for number in range(start, last):
            if pattern.match(lines[number - 1]):
                return number
    return 0


class _Entry:
    """Validates one [[issue]] table; every error names the file and the line of the offending key."""

    def __init__(self, path: str, lines: list[str], start: int, end: int, index: int) -> None:
        self.path, self.lines, self.start, self.end = path, lines, start, end
        self.label = f"known issue #{index + 1}"

    def fail(self, key: str | None, problem: str, fix: str) -> BadKnownIssues:
        line = (_key_line(self.lines, key, self.start, self.end) if key else 0) or self.start
        return BadKnownIssues(self.path, line, f"{self.label} (entry at line {self.start}): {problem}", fix)

    def parse(self, entry: dict[str, Any]) -> KnownIssue:
        if isinstance(entry.get("id"), str) and entry["id"]:
            self.label = f"known issue {entry['id']!r}"
        self._check_keys(entry)
        text = {key: self._text(key, entry.get(key, "")) for key in _TEXT_KEYS}
        if not _ID.match(text["id"]):
            raise self.fail("id", f"id {text['id']!r} has characters other than letters, digits, '.', '_' and '-'",
                            'use a short slug such as "rccl-ll-allreduce-mi350"')
        if text["component"] not in COMPONENTS:
            raise self.fail("component", f"unknown component {text['component']!r}",
                            f"use one of {', '.join(COMPONENTS)}")
        return KnownIssue(
            id=text["id"], component=text["component"], affects=self._affects(entry["affects"]),
            symptom=text["symptom"], workaround=text["workaround"], source=text["source"],
            hardware=text["hardware"], origin=f"{self.path}:{self.start}",
        )

    def _check_keys(self, entry: dict[str, Any]) -> None:
        allowed = REQUIRED_KEYS + OPTIONAL_KEYS
        for key in entry:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.fail(key, f"unknown key {key!r}", f"{hint}an entry has only the keys {', '.join(allowed)}")
        for key in REQUIRED_KEYS:
            if key not in entry:
                raise self.fail(None, f"missing required key {key!r}",
                                f"add {key} = ... to this entry (every entry needs {', '.join(REQUIRED_KEYS)})")

    def _text(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or (key in REQUIRED_KEYS and not value.strip()):
            raise self.fail(key, f"{key!r} must be a non-empty string, not {_describe(value)}", f'write it as {key} = "..."')
        return " ".join(value.split())  # multi-line TOML strings become one header line

    def _affects(self, table: Any) -> tuple[tuple[str, Condition], ...]:
        if not isinstance(table, dict) or not table:
            raise self.fail("affects", f"'affects' must be a non-empty table of conditions, not {_describe(table)}",
                            'add [issue.affects] with lines such as "device.arch" = "gfx950*" (an empty one would match every run)')
        out: list[tuple[str, Condition]] = []
        for field, cond in _flatten(table).items():
            problem = _field_problem(field)
            if problem:
                fix = ("test a variable the fingerprint records, e.g. \"comm.env.NCCL_PROTO\" = \"unset\""
                       if field.startswith("comm.env.") else
                       "name a recorded field as \"section.field\" (docs/known_issues.md lists them)")
                raise self.fail(field, problem, fix)
            out.append((field, self._alternatives(field, cond) if isinstance(cond, list) else self._condition(field, cond)))
        return tuple(out)

    def _alternatives(self, field: str, conds: list[Any]) -> Condition:
        if not conds:
            raise self.fail(field, f"condition on {field} is an empty list", "list at least one alternative")
        if any(isinstance(c, list) for c in conds):
            raise self.fail(field, f"condition on {field} nests a list in a list", "use one flat list of alternatives")
        return tuple(self._condition(field, c) for c in conds)  # type: ignore[misc]

    def _condition(self, field: str, cond: Any) -> str | bool | int:
        if isinstance(cond, bool | int):
            return cond
        if not isinstance(cond, str) or not cond.strip():
            raise self.fail(field, f"condition on {field} must be a string, boolean, integer or list, not {_describe(cond)}",
                            'write a version specifier (">=2.7"), a glob ("gfx950*"), "set"/"unset", true/false or a list')
        cond = cond.strip()
        if cond.startswith(_SPECIFIER_START):
            try:
                SpecifierSet(cond)
            except InvalidSpecifier:
                raise self.fail(
                    field, f"condition on {field}: {cond!r} is not a PEP 440 version specifier",
                    'write e.g. ">=2.7", "==2.27.5", "==2.19.*" or ">=7.0,<7.2" (a leading <>=!~ means a version)',
                ) from None
        return cond


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``device.arch = ...`` unquoted is a nested table in TOML: accept it as the field "device.arch"."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _field_problem(field: str) -> str | None:
    section, _, name = field.partition(".")
    if section not in FIELDS:
        return f"unknown field {field!r}: the sections are {', '.join(FIELDS)}"
    if section == "comm" and name.startswith("env."):
        return _env_problem(field, name[4:])
    # An open name: numerics.determinism.NAME, or packages.NAME for any installed distribution.
    prefix = PREFIXED.get(section)
    if name in FIELDS[section] or (prefix is not None and name.startswith(prefix) and name != prefix):
        return None
    close = difflib.get_close_matches(name, sorted(FIELDS[section]), n=1)
    hint = f" (did you mean {section}.{close[0]}?)" if close else ""
    return f"unknown field {field!r}{hint}; {section} has {', '.join(sorted(FIELDS[section]))}"


def _env_problem(field: str, var: str) -> str | None:
    if recorded_env(var):
        return None
    return (f"{field}: {var or '(empty)'} is never recorded in the fingerprint (recorded: variables starting "
            f"with {', '.join(COMM_ENV_PREFIXES)}, except logging, dump, timing and socket settings)")


def _describe(value: Any) -> str:
    if isinstance(value, list | dict) and not value:
        return f"an empty {'list' if isinstance(value, list) else 'table'}"
    kind = {bool: "a boolean", int: "an integer", float: "a number", list: "a list", dict: "a table", str: "an empty string"}
    return kind.get(type(value), type(value).__name__)
