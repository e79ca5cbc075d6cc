"""The formats scenario's io cases: the quantized checkpoints through the stack's own loaders and writers.

A misread placed inside each real loader (safetensors' load_file and safe_open, torch.load, DCP,
transformers' from_pretrained) must be caught and named with both formats and the factor, for the e4m3
and the e5m2 families (e5m2 only where the path carries it: not transformers' e4m3fn-only layout); a clean
stack passes every path; a known failure of the installed library is reported by name while the
other paths still run; an unknown one fails its path."""

from __future__ import annotations

import re
import tempfile
import types
from pathlib import Path
from typing import Any

import pytest

from pytest_gpuregress import faults
from pytest_gpuregress.errors import NotApplicable
from pytest_gpuregress.reference.record import RunRecord
from pytest_gpuregress.scenarios.base import Case, Setup
from pytest_gpuregress.scenarios.formats import SCENARIO, judge, known_issues, roundtrip
from pytest_gpuregress.scenarios.formats.catalog import IO_PATHS, IO_SCHEMES, SCHEMES
from pytest_gpuregress.triage.naming import described

pytestmark = pytest.mark.cpu_sensitive  # .ci/run runs these again on a lower CPU kernel path

CONFIG = {"model": "tiny-llama", "model_size": "cpu", "seed": 0, "batch": [2, 16]}
E4M3FN = ["per_tensor_e4m3fn"]
E5M2 = ["per_tensor_e4m3fn", "per_tensor_e5m2", "per_tensor_e5m2fnuz"]
E5M2_PATHS = [p for p in IO_PATHS if p != "transformers"]  # transformers' fine-grained fp8 is e4m3fn only


def io_results(paths: list[str], schemes: list[str] = E4M3FN, *specs: str) -> tuple[dict[str, Any], list[int]]:
    """(stack_io results per path, how often each fault fired), one rank in this process."""
    ctx = types.SimpleNamespace(cleanup_hooks=[], rank=0)
    firings = faults.install_counted(list(specs), ctx)
    try:
        *_, io = roundtrip.run(schemes, CONFIG, "cpu", Path(tempfile.mkdtemp()), lambda label: None, paths)
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()
    return io, [f.count for f in firings]


# A path's problem line, field by field (stack_io.PathResult.report), and a misread's (stack_io.misread).
REPORTED = re.compile(r"(?P<scheme>\w+): (?P<call>.+?): (?P<bad>\d+) of (?P<of>\d+) tensors; first (?P<tensor>\S+): "
                      r"(?P<problem>.+)")
MISREAD = re.compile(r"written as (?P<written>\S+) \((?P<tag>\w+)\), read back as (?P<read>\S+): the loader reads "
                     r"(?P<bytes_of>\w+) bytes as (?P<as_of>\w+), (?P<change>.+?); fix: (?P<fix>.+)")


def reported(problem: str) -> dict[str, str]:
    found = REPORTED.fullmatch(problem)
    assert found is not None, problem
    return found.groupdict()


def misread(problem: str) -> dict[str, str]:
    found = MISREAD.fullmatch(reported(problem)["problem"])
    assert found is not None, problem
    return found.groupdict()


def verdict(path: str, io: dict[str, Any]) -> list[str]:
    record = RunRecord(scenario="formats", config={}, platform_key="", world_size=1, results={"io": io})
    found = SCENARIO.own_findings(Case(f"io-{path}", data={"part": "io", "path": path}), record, Setup("cpu", "gloo", 1))
    return [described(problem) for problem in found]


def test_every_path_reads_and_writes_every_scheme_byte_for_byte_on_a_clean_stack() -> None:
    io, _ = io_results(list(IO_PATHS), [*SCHEMES, *IO_SCHEMES])
    for path in IO_PATHS:
        assert io[path]["problems"] == [], path
        assert io[path]["checked"] > 0, path
        assert verdict(path, io) == [] or path == "transformers"  # transformers may skip on an old version
    # Every scheme goes through the generic paths: 7 schemes of 17 weights, 1 probe, with scales and amax.
    assert io["torch_load"]["checked"] >= 7 * 18 * 2


@pytest.mark.parametrize("path", IO_PATHS)
def test_a_fn_to_fnuz_misread_inside_each_real_loader_is_caught_and_named(path: str) -> None:
    spec = f"format:mode=loader_fn_as_fnuz,path={path}"
    io, fired = io_results([path], E4M3FN, spec)
    assert fired[0] > 0  # the fault sat in the loader the path really called
    problems = verdict(path, io)
    assert problems, io[path]
    text = problems[0]
    assert text.startswith(f"[checkpoint] {path} (")
    assert "e4m3fn" in text and "e4m3fnuz" in text and "factor 2" in text
    assert "0x80 -> 0x00 rewrite" in text  # the fix


@pytest.mark.parametrize("path", E5M2_PATHS)
def test_an_e5m2_as_e4m3fn_misread_inside_each_real_loader_is_caught_and_named(path: str) -> None:
    io, fired = io_results([path], E5M2, f"format:mode=loader_e5m2_as_e4m3fn,path={path}")
    assert fired[0] > 0
    problems = verdict(path, io)
    assert problems and all(": per_tensor_e5m2: " in p for p in problems)  # the e4m3fn and e5m2fnuz files read right
    problem = problems[0]
    assert problem.startswith(f"[checkpoint] {path} (") and io[path]["problems"][0] in problem
    first = reported(io[path]["problems"][0])
    assert (first["scheme"], first["tensor"]) == ("per_tensor_e5m2", "model.embed_tokens.weight")
    facts = misread(io[path]["problems"][0])
    assert {k: facts[k] for k in ("written", "tag", "read", "bytes_of", "as_of")} == {
        "written": "torch.float8_e5m2", "tag": "F8_E5M2", "read": "torch.float8_e4m3fn", "bytes_of": "e5m2",
        "as_of": "e4m3fn"}
    assert facts["change"].startswith("values change by no single factor "), facts["change"]
    assert re.match(r".* \(code 0x[0-9A-F]{2} is \S+ in e5m2, \S+ in e4m3fn\)$", facts["change"]), facts["change"]


def test_a_load_file_that_hands_e5m2_back_as_e4m3fn_fails_io_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the public API: the same bytes, the wrong dtype. Only a file with e5m2 tensors can show it."""
    import safetensors.torch
    import torch

    real = safetensors.torch.load_file

    def e5m2_as_e4m3fn(filename: str, device: str = "cpu") -> dict[str, Any]:
        return {k: t.view(torch.float8_e4m3fn) if t.dtype == torch.float8_e5m2 else t
                for k, t in real(filename, device=device).items()}

    monkeypatch.setattr(safetensors.torch, "load_file", e5m2_as_e4m3fn)
    io, _ = io_results(["safetensors"], E5M2)
    [problem] = verdict("safetensors", io)
    assert problem.startswith("[checkpoint] safetensors (safetensors ")
    [raw] = io["safetensors"]["problems"]
    assert raw in problem
    first = reported(raw)
    assert {k: first[k] for k in ("scheme", "call", "bad", "of", "tensor")} == {
        "scheme": "per_tensor_e5m2", "call": "load_file", "bad": "17", "of": "51", "tensor": "model.embed_tokens.weight"}
    facts = misread(raw)
    assert (facts["written"], facts["tag"], facts["read"]) == ("torch.float8_e5m2", "F8_E5M2", "torch.float8_e4m3fn")
    assert (facts["bytes_of"], facts["as_of"]) == ("e5m2", "e4m3fn")
    handed = re.match(r"the loader must hand (\w+) tensors back as (\S+),", facts["fix"])
    assert handed is not None and handed.groups() == ("F8_E5M2", "torch.float8_e5m2"), facts["fix"]


def test_a_loader_that_hands_e5m2fnuz_back_as_e5m2_is_named_with_the_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    real = torch.load

    def fnuz_as_fn(*args: Any, **kwargs: Any) -> Any:
        return {k: t.view(torch.float8_e5m2) if t.dtype == torch.float8_e5m2fnuz else t
                for k, t in real(*args, **kwargs).items()}

    monkeypatch.setattr(torch, "load", fnuz_as_fn)
    io, _ = io_results(["torch_load"], E5M2)
    [problem] = io["torch_load"]["problems"]
    first = reported(problem)
    assert (first["scheme"], first["call"], first["bad"], first["of"]) == \
        ("per_tensor_e5m2fnuz", "torch.load(weights_only=True)", "17", "51")
    facts = misread(problem)
    assert (facts["bytes_of"], facts["as_of"], facts["change"]) == ("e5m2fnuz", "e5m2", "every value 2x (factor 2)")


def test_a_misread_in_torch_load_shows_through_dcp_which_loads_with_it() -> None:
    io, fired = io_results(["dcp"], E4M3FN, "format:mode=loader_fn_as_fnuz,path=torch_load")
    assert fired[0] > 0
    [problem] = io["dcp"]["problems"]
    assert "values read back 0.5x (factor 2)" in problem


def test_a_known_failure_of_the_installed_loader_is_named_and_the_other_paths_still_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors raising KeyError on the F8_E8M0 tag it writes (the MX schemes' scales), as reported with
    a torch that has no float8_e8m0fnu: a known issue by name, a warning, and the other paths go on."""
    import safetensors.torch

    real = safetensors.torch.load_file

    def no_e8m0(filename: str, device: str = "cpu") -> dict[str, Any]:
        if "mx_" in Path(filename).name:
            raise KeyError("F8_E8M0")
        return real(filename, device=device)

    monkeypatch.setattr(safetensors.torch, "load_file", no_e8m0)
    real_installed = known_issues.installed  # the stack it was reported on: a torch without float8_e8m0fnu
    monkeypatch.setattr(known_issues, "installed", lambda d: "2.6.0" if d == "torch" else real_installed(d))
    io, _ = io_results(["safetensors", "torch_load"], ["per_tensor_e4m3fn", "mx_fp8_e4m3fn"])
    assert io["safetensors"]["problems"] == []
    [issue] = io["safetensors"]["known_issues"]
    assert issue.split(": ")[:2] == ["mx_fp8_e4m3fn", "load_file"], issue
    assert "known issue safetensors-e8m0-keyerror " in issue
    assert io["safetensors"]["checked"] > 0 and io["torch_load"]["checked"] > 0  # the rest still ran
    with pytest.warns(judge.KnownStackIssue, match="safetensors-e8m0-keyerror"):
        assert verdict("safetensors", io) == []


def test_an_unknown_failure_of_a_loader_fails_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("storage is corrupt")

    monkeypatch.setattr(torch, "load", broken)
    io, _ = io_results(["torch_load"])
    assert io["torch_load"]["problems"] == ["per_tensor_e4m3fn: torch.load raised RuntimeError: storage is corrupt"]
    assert io["torch_load"]["library"].split()[0] == "torch"
    assert verdict("torch_load", io) == [
        f"[checkpoint] torch_load ({io['torch_load']['library']}): {io['torch_load']['problems'][0]} (rule checkpoint-io)"]


def test_a_path_that_compared_nothing_fails_and_one_that_could_not_run_is_skipped_with_the_reason() -> None:
    empty = {"library": "torch 2.13.0", "problems": [], "known_issues": [], "checked": 0, "skipped": None}
    assert "the path was not exercised" in verdict("dcp", {"dcp": empty})[0]
    with pytest.raises(NotApplicable, match="io-transformers: transformers 4.45.0 cannot load fp8"):
        verdict("transformers", {"transformers": {**empty, "skipped": "transformers 4.45.0 cannot load fp8 here"}})


def test_known_issues_match_only_their_call_symptom_tags_and_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    fp4 = "RuntimeError: shape '[256, 64]' is invalid for input of size 8192"
    f4, fnuz = frozenset({"F4", "F8_E8M0"}), frozenset({"F8_E4M3FNUZ", "F32"})
    versions = {"safetensors": "0.8.0", "torch": "2.13.0"}
    monkeypatch.setattr(known_issues, "installed", lambda d: versions.get(d))
    assert known_issues.match("safetensors", "get_slice", fp4, f4).name == "safetensors-f4-safe-open"
    assert known_issues.match("safetensors", "get_slice", fp4, frozenset({"F8_E4M3"})) is None  # not an fp4 file
    assert known_issues.match("safetensors", "load_file", fp4, f4) is None  # load_file reads it: a new failure
    assert known_issues.match("torch", "get_slice", fp4, f4) is None
    # 0.8.0 writes fnuz: the same words from it are a regression, not the old issue
    assert known_issues.match("safetensors", "save_file", "KeyError: torch.float8_e4m3fnuz", fnuz) is None
    versions["safetensors"] = "0.7.0"
    assert known_issues.match("safetensors", "save_file", "KeyError: torch.float8_e4m3fnuz", fnuz).name \
        == "safetensors-no-fnuz"
    assert known_issues.match("safetensors", "load_file", "SafetensorError: InvalidHeaderDeserialization",
                              frozenset({"F8_E4M3", "F32"})) is None  # a plain fp8 file it cannot read: a failure
    # e5m2fnuz is the same issue, in the words safetensors 0.7.0 says it (measured)
    e5m2fnuz = frozenset({"F8_E5M2FNUZ", "F32"})
    unknown = ("SafetensorError: Error while deserializing header: invalid JSON in header: unknown variant "
               "`F8_E5M2FNUZ`, expected one of `BOOL`, `F4`, `F6_E2M3`, `F6_E3M2`, `U8`, `I8`, `F8_E5M2`, `F8_E4M3`")
    assert known_issues.match("safetensors", "save_file", "KeyError: torch.float8_e5m2fnuz", e5m2fnuz).name \
        == known_issues.match("safetensors", "get_slice", unknown, e5m2fnuz).name == "safetensors-no-fnuz"
    assert known_issues.match("safetensors", "load_file", unknown, frozenset({"F8_E5M2", "F32"})) is None
    versions["safetensors"] = "0.8.0"
    assert known_issues.match("safetensors", "load_file", unknown, e5m2fnuz) is None


def test_a_safetensors_without_the_e5m2fnuz_tag_gives_the_known_issue_not_a_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What safetensors 0.7.0 does with the e5m2fnuz file (measured): the named issue of e4m3fnuz, and the
    e4m3fn and e5m2 files still compared."""
    import safetensors.torch

    real_save, real_load = safetensors.torch.save_file, safetensors.torch.load_file

    def no_fnuz_save(tensors: dict[str, Any], filename: str, metadata: Any = None) -> None:
        fnuz = [t.dtype for t in tensors.values() if "fnuz" in str(t.dtype)]
        if fnuz:
            raise KeyError(fnuz[0])
        real_save(tensors, filename, metadata=metadata)

    def no_fnuz_load(filename: str, device: str = "cpu") -> dict[str, Any]:
        if "fnuz" in Path(filename).name:
            raise RuntimeError("Error while deserializing header: invalid JSON in header: unknown variant "
                               "`F8_E5M2FNUZ`, expected one of `BOOL`, `F4`, `U8`, `F8_E5M2`, `F8_E4M3`")
        return real_load(filename, device=device)

    monkeypatch.setattr(safetensors.torch, "save_file", no_fnuz_save)
    monkeypatch.setattr(safetensors.torch, "load_file", no_fnuz_load)
    real_installed = known_issues.installed
    monkeypatch.setattr(known_issues, "installed", lambda d: "0.7.0" if d == "safetensors" else real_installed(d))
    io, _ = io_results(["safetensors"], E5M2)
    assert io["safetensors"]["problems"] == []
    assert [i.split(": known issue ")[0] for i in io["safetensors"]["known_issues"]] == [
        "per_tensor_e5m2fnuz: save_file", "per_tensor_e5m2fnuz: load_file"]
    assert all("safetensors-no-fnuz" in i for i in io["safetensors"]["known_issues"])
    assert io["safetensors"]["checked"] == 4 * 51  # e4m3fn and e5m2, each written and read
    with pytest.warns(judge.KnownStackIssue, match="safetensors-no-fnuz"):
        assert verdict("safetensors", io) == []


def test_a_path_whose_every_scheme_ended_in_a_known_issue_fails_as_not_exercised() -> None:
    result = {"library": "safetensors 0.5.3", "problems": [], "checked": 0, "skipped": None,
              "known_issues": ["per_tensor_e4m3fn: load_file: known issue ..."]}
    with pytest.warns(judge.KnownStackIssue):
        [problem] = verdict("safetensors", {"safetensors": result})
    assert "compared no tensor" in problem


def test_a_torch_save_whose_file_is_wrong_fails_even_when_its_load_undoes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that flips a bit in every e4m3fn byte and a load that flips it back pass a round trip; the archive's
    raw storages, read without unpickling, show it."""
    import torch

    real_save, real_load = torch.save, torch.load

    def flip(state: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.view(torch.uint8) ^ 1).view(v.dtype) if v.dtype == torch.float8_e4m3fn else v
                for k, v in state.items()}

    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real_save(flip(obj), f, *a, **k))
    monkeypatch.setattr(torch, "load", lambda *a, **k: flip(real_load(*a, **k)))
    io, _ = io_results(["torch_load"])
    [problem] = io["torch_load"]["problems"]
    first = reported(problem)
    assert {k: first[k] for k in ("scheme", "call", "bad", "of", "tensor")} == {
        "scheme": "per_tensor_e4m3fn", "call": "torch.save", "bad": "17", "of": "51", "tensor": "model.embed_tokens.weight"}
    assert first["problem"].startswith("its bytes are in no storage"), problem


def test_slices_from_the_middle_the_end_and_by_column_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A get_slice that ignores a start offset passes a [:] and a [0:1] cut; the middle and last rows show it."""
    import safetensors

    from pytest_gpuregress.faults.loaders import _Handle, _Slice

    class FromTheStart(_Slice):
        def __getitem__(self, index: Any) -> Any:
            rows = index[0] if isinstance(index, tuple) else index
            if isinstance(rows, slice) and rows.start:
                index = (slice(0, rows.stop - rows.start), *index[1:]) if isinstance(index, tuple) else \
                    slice(0, rows.stop - rows.start)
            return self._inner[index]

    class Handle(_Handle):
        def get_slice(self, name: str) -> Any:
            return FromTheStart(self._inner.get_slice(name), self._misread)

    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: Handle(real(*a, **k), None))
    io, _ = io_results(["safe_open"])
    problems = io["safe_open"]["problems"]
    assert any("get_slice[mid:mid+2]" in p for p in problems) and any("get_slice[-1:]" in p for p in problems)
    assert not any("get_slice[0:1]" in p or "get_slice[:]" in p for p in problems)


def test_the_fault_and_the_scenario_name_the_same_paths() -> None:
    from pytest_gpuregress.faults import KINDS
    from pytest_gpuregress.faults.loaders import TARGETS

    assert tuple(TARGETS) == IO_PATHS
    assert KINDS["format"].params["path"].choices == IO_PATHS


def test_transformers_reading_the_wrong_blocks_scale_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each weight has many 16 x 16 blocks with scales of their own: a dequantization that takes its scale grid
    transposed (a wrong block for most values) must fail, as a real fine-grained checkpoint would show."""
    from transformers.integrations import finegrained_fp8

    real = finegrained_fp8.Fp8Dequantize._dequantize_one

    def transposed(self: Any, quantized: Any, scales: Any, output_dtype: Any = None) -> Any:
        flipped = scales.transpose(-1, -2).contiguous() if scales.shape[-1] == scales.shape[-2] else scales.flip(-1)
        return real(self, quantized, flipped, output_dtype=output_dtype)

    monkeypatch.setattr(finegrained_fp8.Fp8Dequantize, "_dequantize_one", transposed)
    io, _ = io_results(["transformers"])
    [problem] = io["transformers"]["problems"]
    assert "from_pretrained" in problem and "dequantized values differ" in problem and "code x block scale" in problem


def test_a_transformers_refusal_is_a_finding_not_a_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaForCausalLM

    refusal = "weight_scale_inv does not match weight_block_size of the quantization_config"

    def refuses(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(refusal)

    monkeypatch.setattr(LlamaForCausalLM, "from_pretrained", refuses)
    io, _ = io_results(["transformers"])
    assert io["transformers"]["skipped"] is None
    assert io["transformers"]["problems"] == [f"fine_grained_e4m3fn: from_pretrained raised ValueError: {refusal}"]
