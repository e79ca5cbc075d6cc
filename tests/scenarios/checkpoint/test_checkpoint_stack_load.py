"""The checkpoint scenario reads what the stack wrote, through the stack's loader (issue #23 item 5).

Each test makes the stack's loader (``safetensors.torch.load_file`` / ``load_model``) change what it
reads, and checks that the case owning that load catches it: a load that went around the stack (the
plugin's own reader and copy, or our in-memory tensors) would not see the change and pass. Clean
runs of the same paths pass. One process, no ranks, a few seconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import safetensors.torch
import torch

from pytest_gpuregress import faults
from pytest_gpuregress.cli import main
from pytest_gpuregress.resources import shipped_dir
from pytest_gpuregress.scenarios.base import RankContext
from pytest_gpuregress.scenarios.checkpoint import checks, files, full_state, plan, portable, rank
from pytest_gpuregress.training.models import build_causal_lm, load_config, model_dir

CONFIG = model_dir("tiny-llama", "cpu")
TIED_CONFIG = model_dir("tiny-llama-tied", "cpu")
SHIPPED = shipped_dir("reference_runs")
BUNDLE = SHIPPED / "checkpoint" / "cpu-gloo-w2-fp32"
NUDGED = "model.norm.weight"  # 64 ones at init: element 0 one ulp up reads 1.0 -> 1.0000001192092896


def one_ulp_up(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()  # load_file's tensors may be backed by the file's pages
    flat = out.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
    return out


@pytest.fixture
def nudging_loader(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``safetensors.torch.load_file`` moves element 0 of NUDGED one ulp up; returns the files it read."""
    real = safetensors.torch.load_file
    read: list[str] = []

    def load_file(filename: Any, device: Any = "cpu", **kwargs: Any) -> dict[str, torch.Tensor]:
        read.append(str(filename))
        tensors = real(filename, device=device, **kwargs)
        return {k: one_ulp_up(v) if k in (NUDGED, files.BUNDLE_PREFIX + NUDGED) else v for k, v in tensors.items()}

    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    return read


NUDGE_SEEN = "1 of 64 elements differ, first at (0,): 1.0 -> 1.0000001192092896, 1 ulp"
# A finding's fields: a tensor the model holds otherwise than the file (portable.evaluate), a tie lost (full_state).
NOT_HELD = re.compile(r"(?P<tensor>\S+): the tensor the model holds after the load is not the file's "
                      r"\((?P<count>\d+) of (?P<of>\d+) elements differ, first at \((?P<at>[\d, ]*)\): "
                      r"(?P<was>[0-9.]+) -> (?P<now>[0-9.]+), (?P<ulps>\d+) ulps?\)")
TIE_LOST = re.compile(r"the tie (?P<names>.+) is lost after reload: (?P<tensors>\d+) tensors \(equal copies\), not one "
                      r"storage under both names")


def not_held(findings: list[str]) -> list[dict[str, str]]:
    return [m.groupdict() for m in map(NOT_HELD.fullmatch, findings) if m]


def lost_ties(findings: list[str]) -> list[tuple[list[str], int]]:
    """(the tied names, how many tensors they are now) of each finding; a finding of another form fails the test."""
    matched = [TIE_LOST.fullmatch(f) for f in findings]
    assert all(matched), findings
    return [(m["names"].split(" = "), int(m["tensors"])) for m in matched if m]


TIED = ["model.embed_tokens.weight", "lm_head.weight"]


# --- 1. the full-state-dict and tied reloads go through safetensors.torch.load_model ---------------------


def built_model(config_dir: Path) -> tuple[Any, Any]:
    """(config, model): a freshly built model stands in for a trained one (the round trip copies whatever it holds)."""
    model_config = load_config(str(config_dir), "cpu")
    return model_config, build_causal_lm(model_config, seed=3).eval()


def roundtrip(config_dir: Path, folder: Path) -> list[str]:
    """full_state.roundtrip of a plain (unsharded) model: what rank 0 does with the gathered state."""
    model_config, model = built_model(config_dir)
    trained = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    logits = full_state.logits_of(model, torch.device("cpu"), int(model_config.vocab_size))
    findings, _ = full_state.roundtrip(state, trained, logits, model_config, "the config", folder, torch.device("cpu"))
    return findings


@pytest.mark.parametrize("config_dir", [CONFIG, TIED_CONFIG], ids=["untied", "tied"])
def test_a_clean_round_trip_through_the_stacks_loader_passes(config_dir: Path, tmp_path: Path) -> None:
    assert roundtrip(config_dir, tmp_path) == []


def test_the_full_state_reload_is_what_the_stacks_loader_made_of_the_file(tmp_path: Path,
                                                                         nudging_loader: list[str]) -> None:
    findings = roundtrip(CONFIG, tmp_path)
    assert f"{NUDGED} after reload: {NUDGE_SEEN}" in findings  # the file itself is fine: check_file is silent
    assert nudging_loader == [str(tmp_path / "model.safetensors")]  # once, by load_model


def test_a_loader_that_unties_is_caught_by_the_tie_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = safetensors.torch.load_model

    def untying_load_model(model: Any, filename: Any, **kwargs: Any) -> Any:  # transformers#38870's kind of loader
        result = real(model, filename, **kwargs)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        return result

    monkeypatch.setattr(safetensors.torch, "load_model", untying_load_model)
    assert lost_ties(roundtrip(TIED_CONFIG, tmp_path)) == [(TIED, 2)]


def test_the_untied_fault_breaks_the_tie_after_the_stacks_load_and_is_caught(tmp_path: Path) -> None:
    ctx = SimpleNamespace(rank=0, cleanup_hooks=[], step_hooks=[])
    (firing,) = faults.install_counted(["checkpoint:mode=untied"], ctx)
    try:
        findings = roundtrip(TIED_CONFIG, tmp_path)
    finally:
        for undo in reversed(ctx.cleanup_hooks):
            undo()
    assert firing.count == 1
    assert lost_ties(findings) == [(TIED, 2)]


def test_the_stacks_refusal_is_one_checkpoint_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing_load_model(model: Any, filename: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Error(s) in loading state_dict for LlamaForCausalLM:\n    Missing key(s): \"x\"")

    monkeypatch.setattr(safetensors.torch, "load_model", refusing_load_model)
    findings = roundtrip(CONFIG, tmp_path)
    assert len(findings) == 1 and findings[0].startswith("reloading the saved file failed: ")
    refused = re.search(r"(\S+)\(strict=True\) refused it: Error\(s\) in loading state_dict for (\w+): (.+)",
                        findings[0])
    assert refused is not None and refused.groups()[:2] == ("safetensors.torch.load_model", "LlamaForCausalLM")
    assert refused.group(3).startswith('Missing key(s): "x"') and "\n  fix: " in findings[0]


# --- 2. the bundle keeps the file the stack wrote, as the stack reads it ----------------------------------


@pytest.mark.parametrize("name", ["checkpoint", "checkpoint-tiny-llama-tied", "checkpoint-tiny-moe"])
def test_the_bundle_arrays_of_the_written_file_are_the_shipped_references_bit_for_bit(name: str,
                                                                                    tmp_path: Path) -> None:
    """The shipped tensors written the way rank 0 writes them, then read back as the bundle: identical bytes."""
    record = checks.read_bundle(SHIPPED / name / "cpu-gloo-w2-fp32")
    shipped = {k: v for k, v in record.arrays.items() if k.startswith(files.BUNDLE_PREFIX)}
    groups = portable.tie_groups(portable.empty_model(load_config(str(model_dir(record.config["model"], "cpu")), "cpu")))
    tensors = {k[len(files.BUNDLE_PREFIX):]: torch.from_numpy(v) for k, v in shipped.items()}
    full_state.write(tmp_path / "model.safetensors", tensors, groups)
    arrays = full_state.saved_arrays(tmp_path / "model.safetensors")
    assert sorted(arrays) == sorted(shipped)
    for key, expected in shipped.items():
        got = arrays[key]
        assert (got.dtype, got.shape, got.tobytes()) == (expected.dtype, expected.shape, expected.tobytes()), key


def test_the_bundle_arrays_come_from_the_stacks_read_of_the_file(tmp_path: Path, nudging_loader: list[str]) -> None:
    model_config, model = built_model(CONFIG)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    full_state.write(tmp_path / "model.safetensors", state, portable.tie_groups(model))
    arrays = full_state.saved_arrays(tmp_path / "model.safetensors")
    assert nudging_loader == [str(tmp_path / "model.safetensors")]
    expected = state[NUDGED].numpy()
    assert portable.describe_difference(expected, arrays[files.BUNDLE_PREFIX + NUDGED]) == NUDGE_SEEN
    assert all(arrays[files.BUNDLE_PREFIX + n].tobytes() == t.numpy().tobytes() for n, t in state.items() if n != NUDGED)


# --- 3. checksums: the stack's load against the strict reader's independent parse -------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    _, model = built_model(CONFIG)
    safetensors.torch.save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, str(path))
    return path


def test_the_checksums_compare_the_stacks_load_with_the_files_own_bytes(checkpoint: Path,
                                                                        nudging_loader: list[str]) -> None:
    evaluation = portable.evaluate(files.read(checkpoint), load_config(str(CONFIG), "cpu"), "the config",
                                   with_float64=False)
    assert nudging_loader == [str(checkpoint)]
    assert evaluation.checksums[NUDGED]["sha256"] != evaluation.file_checksums[NUDGED]
    assert len(evaluation.problems) == 1 and not_held(evaluation.problems) == [
        {"tensor": NUDGED, "count": "1", "of": "64", "at": "0,", "was": "1.0", "now": "1.0000001192092896", "ulps": "1"}]


def test_a_tied_checkpoint_loads_through_the_stack_with_its_tie(tmp_path: Path) -> None:
    model_config, model = built_model(TIED_CONFIG)
    groups = portable.tie_groups(model)
    full_state.write(tmp_path / "model.safetensors", full_state.tensors_to_save(model.state_dict(), groups), groups)
    loaded = portable.empty_model(model_config)
    portable.load(loaded, files.read(tmp_path / "model.safetensors"))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


# --- 4. the portability case and the CLI read the shipped bundle through the stack --------------------------


def portability_findings() -> Iterator[str]:
    """The portability case on rank 0, in this process, against the shipped bundle (the tolerant lane: a
    fingerprint that is not the bundle's)."""
    ctx = RankContext(rank=0, world_size=1, local_rank=0, device_kind="cpu", backend="gloo",
                      config={"role": "portability", "bundle": str(BUNDLE)}, run_dir=Path("."),
                      fingerprint={"versions": {"torch": "0.0"}})
    result = rank.run_portability(ctx).results["portability"]
    assert result["ran"] and result["lane"] == "tolerant", result
    yield from result["findings"]


def test_the_portability_case_on_the_shipped_bundle_passes_clean() -> None:
    assert list(portability_findings()) == []


def test_the_portability_case_loads_the_bundle_through_the_stack(nudging_loader: list[str]) -> None:
    findings = list(portability_findings())
    assert nudging_loader == [str(BUNDLE / files.BUNDLE_TENSORS)]
    held = [{k: f[k] for k in ("tensor", "count", "of", "at", "ulps")} for f in not_held(findings)]
    assert held == [{"tensor": NUDGED, "count": "1", "of": "64", "at": "0,", "ulps": "1"}], findings
    assert any(f.startswith(f"{NUDGED}: checksum differs") for f in findings)  # against the recorded checksum too


def test_the_cli_loads_the_bundle_through_the_stack(nudging_loader: list[str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    args = ["portability", str(BUNDLE), "--config", str(CONFIG), "--device", "cpu", "--no-float64"]
    assert main(args) == 1
    printed = capsys.readouterr().out
    assert nudging_loader == [str(BUNDLE / files.BUNDLE_TENSORS)]
    line = re.search("DIFFERS: " + NOT_HELD.pattern, printed)
    assert line is not None, printed
    assert {k: line[k] for k in ("tensor", "count", "of", "at", "ulps")} == {
        "tensor": NUDGED, "count": "1", "of": "64", "at": "0,", "ulps": "1"}


def test_the_cli_on_the_shipped_bundle_passes_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["portability", str(BUNDLE), "--config", str(CONFIG), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("SAME")


def test_plan_ships_the_bundle_these_tests_load() -> None:
    assert plan.shipped_bundle().resolve() == BUNDLE
