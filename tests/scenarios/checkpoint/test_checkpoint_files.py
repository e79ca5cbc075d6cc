"""Loading a checkpoint a user points to, and ``gpuregress portability``: one process, no ranks, a few seconds.

Bad input (a truncated shard, a missing key, a dtype or shape the config does not have, a
checkpoint for another architecture, a pickle) gets one error that names the file and the fix;
a clean checkpoint loads bit for bit with its tie intact; two machines' results agree or not.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pytest_gpuregress.cli import main
from pytest_gpuregress.cli import portability as cli
from pytest_gpuregress.errors import CheckpointProblem
from pytest_gpuregress.scenarios.checkpoint import files, full_state, hooks, portable
from pytest_gpuregress.training.models import build_causal_lm, load_config, model_dir

CONFIG = model_dir("tiny-llama", "cpu")
TIED_CONFIG = model_dir("tiny-llama-tied", "cpu")


def state_of(config_dir: Path, seed: int = 3) -> dict[str, torch.Tensor]:
    model = build_causal_lm(load_config(str(config_dir), "cpu"), seed=seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_file(state_of(CONFIG), str(path))
    return path


def problem(path: Path, config: Path = CONFIG) -> CheckpointProblem:
    with pytest.raises(CheckpointProblem) as info:
        model_config = load_config(str(config), "cpu")
        portable.evaluate(files.read(path), model_config, f"the config {config}", with_float64=False)
    return info.value


# --- bad input -------------------------------------------------------------------------------------------


def test_a_truncated_file_is_named_with_the_fix(checkpoint: Path, tmp_path: Path) -> None:
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(checkpoint.read_bytes()[:-1000])
    found = problem(cut)
    assert found.path == str(cut) and "points past the end of the file" in found.problem
    assert "export it again" in found.fix


def test_a_truncated_shard_of_a_sharded_checkpoint_names_the_shard(tmp_path: Path) -> None:
    state = state_of(CONFIG)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / shard))
    (tmp_path / files.INDEX).write_text(json.dumps({"weight_map": {k: s for s, ks in halves.items() for k in ks}}))
    clean = files.read(tmp_path)
    assert len(clean.tensors) == len(state)
    second = tmp_path / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-4])
    found = problem(tmp_path)
    assert found.path == str(second) and "export it again" in found.fix
    second.unlink()
    gone = problem(tmp_path)
    assert gone.path == str(second) and gone.problem.startswith("missing: the index lists") and "copy every shard" in gone.fix


def test_a_missing_key_is_named(tmp_path: Path) -> None:
    state = state_of(CONFIG)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    found = problem(tmp_path)
    assert found.tensor == "model.layers.1.mlp.up_proj.weight" and found.path == str(tmp_path)
    assert found.problem.startswith(f"missing: the config {CONFIG} builds ") and "with this tensor" in found.problem
    counted = re.search(r"; (\d+) of (\d+) tensors are missing \(", found.problem)
    assert counted is not None and counted.groups() == ("1", "21"), found.problem
    assert "save the checkpoint again" in found.fix and "with every tensor" in found.fix


def test_a_dtype_other_than_the_configs_is_named(tmp_path: Path) -> None:
    config = tmp_path / "bf16-config"
    shutil.copytree(CONFIG, config)
    fields = json.loads((config / "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**fields, "dtype": "bfloat16"}))
    save_file(state_of(CONFIG), str(tmp_path / "model.safetensors"))
    found = problem(tmp_path / "model.safetensors", config)
    assert found.path == str(tmp_path / "model.safetensors") and found.tensor == "model.embed_tokens.weight"
    assert "dtype float32 (F32), but the config" in found.problem and "says dtype bfloat16" in found.problem
    assert "convert the checkpoint to bfloat16" in found.fix


def test_a_shape_other_than_the_configs_is_named(tmp_path: Path) -> None:
    config = tmp_path / "wider"
    shutil.copytree(CONFIG, config)
    fields = json.loads((config / "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**fields, "vocab_size": 512}))
    save_file(state_of(CONFIG), str(tmp_path / "model.safetensors"))
    found = problem(tmp_path / "model.safetensors", config)
    assert found.tensor == "model.embed_tokens.weight"
    shapes = re.match(r"shape (\[[\d, ]+\]), but the config .* builds (\[[\d, ]+\]) \((\d+) of (\d+) tensors ",
                      found.problem)
    assert shapes is not None and shapes.groups() == ("[256, 64]", "[512, 64]", "2", "21"), found.problem


def test_a_checkpoint_for_another_architecture_says_so(tmp_path: Path) -> None:
    gpt2 = {f"transformer.h.{i}.attn.c_attn.weight": torch.zeros(64, 192) for i in range(2)}
    gpt2["transformer.wte.weight"] = torch.zeros(256, 64)
    save_file(gpt2, str(tmp_path / "model.safetensors"))
    found = problem(tmp_path / "model.safetensors")
    counted = re.search(r"another architecture: (\d+) of the (\d+) tensors", found.problem)
    assert counted is not None and counted.groups() == ("21", "21"), found.problem
    assert "'transformer.h.0.attn.c_attn.weight'" in found.problem and "--config" in found.fix


def test_a_pickle_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"not even opened")
    found = problem(path)
    assert "a pickle: " in found.problem and "never unpickles" in found.problem and "safetensors" in found.fix


# --- clean loads and the detectors on them ---------------------------------------------------------------


def test_a_clean_checkpoint_loads_bit_for_bit_within_the_float64_bound(checkpoint: Path) -> None:
    model_config = load_config(str(CONFIG), "cpu")
    evaluation = portable.evaluate(files.read(checkpoint), model_config, "the config")
    assert evaluation.problems == []
    assert all(evaluation.checksums[n]["sha256"] == evaluation.file_checksums[n] for n in evaluation.file_checksums)
    assert evaluation.deviation is not None and 0 < evaluation.deviation <= evaluation.bound
    assert evaluation.bound == pytest.approx(2**-24 * 176**0.5 * 3)  # u sqrt(intermediate size) (layers + 1)


def test_a_one_ulp_change_after_the_load_is_caught_by_the_checksum(checkpoint: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def nudge(tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            flat = tensors["model.norm.weight"].view(-1)
            flat[3] = torch.nextafter(flat[3], torch.tensor(2.0))

    monkeypatch.setattr(hooks, "after_load", nudge)
    evaluation = portable.evaluate(files.read(checkpoint), load_config(str(CONFIG), "cpu"), "the config",
                                   with_float64=False)
    changed = [n for n, sha in evaluation.file_checksums.items() if evaluation.checksums[n]["sha256"] != sha]
    assert changed == ["model.norm.weight"]
    [said] = evaluation.problems
    name, _, how = said.partition(": the tensor the model holds after the load is not the file's ")
    assert name == "model.norm.weight", said
    detail = re.fullmatch(r"\((\d+) of (\d+) elements differ, first at \((\d+),\): (\S+) -> (\S+), (\d+) ulp\)", how)
    assert detail is not None and detail.groups() == ("1", "64", "3", "1.0", "1.0000001192092896", "1"), said


def test_a_tied_model_round_trips_with_one_storage_and_the_lost_tie_is_caught(tmp_path: Path) -> None:
    model_config = load_config(str(TIED_CONFIG), "cpu")
    groups = portable.tie_groups(build_causal_lm(model_config, seed=0))
    assert groups[0] == ["model.embed_tokens.weight", "lm_head.weight"]
    state = state_of(TIED_CONFIG)
    full_state.write(tmp_path / "model.safetensors", full_state.tensors_to_save(state, groups), groups)
    assert "lm_head.weight" not in files.read(tmp_path / "model.safetensors").tensors  # stored once
    model = full_state.reload(tmp_path / "model.safetensors", model_config, "the config")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert full_state.check_ties(model, groups) == []
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    [lost] = full_state.check_ties(model, groups)
    assert lost.startswith(f"the tie {' = '.join(groups[0])} is lost after reload: "), lost  # the group read above
    assert "2 tensors (equal copies)" in lost and lost.endswith("not one storage under both names")


def test_a_saved_file_holding_one_ranks_shard_is_named() -> None:
    trained = {"w": np.zeros((4, 3), dtype=np.float32)}
    saved = files.CheckpointFiles(Path("x"), {"w": np.zeros((2, 3), dtype=np.float32)}, {"w": "F32"})
    [sliced] = full_state.check_file(saved, trained, [["w"]])
    shapes = re.match(r"w saved with shape (\[[\d, ]+\]), the model's is (\[[\d, ]+\]): ", sliced)
    assert shapes is not None and shapes.groups() == ("[2, 3]", "[4, 3]"), sliced
    assert sliced.endswith("one rank's shard, not the whole tensor")
    assert full_state.check_file(files.CheckpointFiles(Path("x"), trained, {"w": "F32"}), trained, [["w"]]) == []


# --- the command line ------------------------------------------------------------------------------------


def test_cli_writes_a_result_that_another_machine_compares_with(checkpoint: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "here.portability"
    assert main(["portability", str(checkpoint), "--config", str(CONFIG), "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "logits on the fixed batch " in printed and "[2, 16] -> [2, 16, 256]" in printed
    assert "deviation from float64" in printed
    assert "model.layers.1.mlp.down_proj.weight" in printed and printed.rstrip().endswith("SAME")
    assert main(["portability", str(checkpoint), "--config", str(CONFIG), "--against", str(out)]) == 0
    assert "21 of 21 checksums equal" in capsys.readouterr().out

    there, logits = cli.read(out)  # the other machine: one tensor loaded otherwise, logits drifted past the bound
    there["checksums"]["model.norm.weight"]["sha256"] = "0" * 64
    cli.write(out, there, logits * np.float32(1 + 1e-4))
    assert main(["portability", str(checkpoint), "--config", str(CONFIG), "--against", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "DIFFERS: model.norm.weight: checksum differs" in printed and "sha256 000000000000... there" in printed
    drift = re.search(r"DIFFERS: logits on the fixed batch differ by (\S+) of their largest, beyond the "
                      r"cross-platform tolerance (\S+) ", printed)
    assert drift is not None and float(drift.group(1)) == pytest.approx(1e-4, rel=1e-2), printed
    assert float(drift.group(2)) < float(drift.group(1))
    assert "20 of 21 checksums equal" in printed


def test_cli_drift_within_the_bound_still_agrees(checkpoint: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "there.portability"
    assert main(["portability", str(checkpoint), "--config", str(CONFIG), "--out", str(out)]) == 0
    there, logits = cli.read(out)
    cli.write(out, there, logits * np.float32(1 + 5e-7))  # the size of legitimate kernel drift (docs/faults.md 4)
    assert main(["portability", str(checkpoint), "--config", str(CONFIG), "--against", str(out)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("SAME")


@pytest.mark.parametrize("what", ["truncated", "not a result"])
def test_cli_bad_input_is_one_message_with_the_file_and_the_fix(checkpoint: Path, tmp_path: Path, what: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    if what == "truncated":
        bad = tmp_path / "model.safetensors"
        bad.write_bytes(checkpoint.read_bytes()[: len(checkpoint.read_bytes()) // 2])
        args = ["portability", str(bad), "--config", str(CONFIG)]
    else:
        bad = checkpoint  # a checkpoint is not a file --out wrote
        args = ["portability", str(checkpoint), "--config", str(CONFIG), "--against", str(checkpoint)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpuregress: {bad}") and "\n  fix: " in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 2
