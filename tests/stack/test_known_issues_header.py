"""Known issues in the report header, through pytest: a faked MI350 fingerprint shows the shipped RCCL
entry with its workaround; a user's file adds entries; a malformed one stops the session naming file and line."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuregress.plugin import reporting
from pytest_gpuregress.stack import fingerprint


def fake_mi350(monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None) -> None:
    real = fingerprint.collect

    def collect(*args: Any, **kwargs: Any) -> Any:
        fp = real(*args, **kwargs)
        fp["device"].update(kind="cuda", name="AMD Instinct MI355X", arch="gfx950:sramecc+:xnack-", hip="7.1.25424",
                            count=8)
        fp["comm"].update(backend="nccl", env=dict(env or {}))
        return fp

    monkeypatch.setattr(fingerprint, "collect", collect)
    # plugin/reporting.py binds collect at its import, which a test module of this process may already have done
    monkeypatch.setattr(reporting, "collect", collect)


def header(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", "--collect-only", *args)


def test_a_known_issue_matching_the_fingerprint_is_printed_with_its_workaround(pytester: pytest.Pytester,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fake_mi350(monkeypatch)
    result = header(pytester)
    result.stdout.fnmatch_lines([
        "gpuregress KNOWN ISSUE rccl-ll-allreduce-mi350 (collective, AMD Instinct MI350 series*LL-protocol*",
        "gpuregress KNOWN ISSUE rccl-ll-allreduce-mi350 workaround: *NCCL_PROTO=Simple*ROCm 7.1.1*",
    ])


def test_the_workaround_applied_ends_the_match_and_this_cpu_matches_nothing(pytester: pytest.Pytester,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert "KNOWN ISSUE" not in header(pytester).stdout.str()  # the real stack: a CPU with gloo
    fake_mi350(monkeypatch, env={"NCCL_PROTO": "Simple"})
    assert "rccl-ll-allreduce-mi350" not in header(pytester).stdout.str()


def test_a_users_entry_is_matched_and_a_malformed_one_names_file_and_line(pytester: pytest.Pytester) -> None:
    pytester.makefile(".toml", known='''
[[issue]]
id = "site-gloo-cpu"
component = "collective"
symptom = "our CPU runners drop gloo connections"
workaround = "set GLOO_SOCKET_TIMEOUT"
source = "ticket OPS-1234"
[issue.affects]
"device.kind" = "cpu"
''')
    pytester.makeini("[pytest]\ngpuregress_known_issues = known.toml\n")
    header(pytester).stdout.fnmatch_lines(["gpuregress KNOWN ISSUE site-gloo-cpu (collective*our CPU runners*",
                                           "*workaround: set GLOO_SOCKET_TIMEOUT [[]source: ticket OPS-1234[]]*"])
    bad = pytester.makefile(".toml", bad='''
[[issue]]
id = "fine"
component = "kernel"
symptom = "s"
workaround = "w"
source = "x"
[issue.affects]
"device.kind" = "cpu"

[[issue]]
id = "broken"
component = "kernel"
symptom = "s"
workaround = "w"
[issue.affects]
"device.kind" = "cpu"
''')
    line = bad.read_text().splitlines().index('id = "broken"')  # 0-based: the [[issue]] line above it, 1-based
    result = header(pytester, f"--gpuregress-known-issues={bad}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*gpuregress_known_issues: {bad}:{line}: *'broken'*missing required key 'source'*"])
