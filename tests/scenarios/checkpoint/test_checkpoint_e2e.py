"""The checkpoint scenario end to end through pytester: real gloo ranks, FSDP2, DCP, injected faults.

One reference (the default 10 steps) is recorded once for the module; every test compares against
it, and the portability case loads its bundle. Each fault is caught by the case that owns its bug
class, with the piece of state named: a parameter, ``optimizer.exp_avg``, ``rng.numpy``, a shard file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ...conftest import kept_run_passes, record_references, reproduced

pytestmark = pytest.mark.slow

PLATFORM = "cpu-gloo-w2-fp32"
NUDGED = "model.layers.1.self_attn.q_proj.weight"  # ulp_nudge's default tensor
TIED = ["model.embed_tokens.weight", "lm_head.weight"]  # the tiny tied Llama's tie group
# A reshard finding as the report prints it, read back into its fields.
PERMUTED = re.compile(r"\[checkpoint\] sharded-(\d)to(\d): (\S+) of (\S+) (\[[\d, ]+\]): the full-tensor hash differs after "
                      r"saving at world size (\d) and loading at (\d); its (\d+) chunks along dim 0 come back in the "
                      r"order (\[[\d, ]+\]): chunks permuted when resharding (\d) -> (\d)")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    refs = record_references(tmp_path_factory.mktemp("checkpoint"), "-k", "checkpoint and full-state-dict")
    assert (refs / "checkpoint" / PLATFORM / "manifest.json").is_file()
    return refs


def run(pytester: pytest.Pytester, refs: Path, selection: str, *extra: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", "--gpuregress", f"--gpuregress-reference-dir={refs}",
                              f"--gpuregress-portable-checkpoint={refs / 'checkpoint' / PLATFORM}",
                              f"--gpuregress-checkpoint-dir={pytester.path / 'checkpoints'}",
                              "-k", f"checkpoint and ({selection})", *extra)


def inject(pytester: pytest.Pytester, refs: Path, selection: str, mode: str, failed: int) -> str:
    result = run(pytester, refs, selection, f"--gpuregress-inject=checkpoint:mode={mode}")
    result.assert_outcomes(failed=failed)
    assert not list((pytester.path / "checkpoints").iterdir())  # removed after a failure too
    return result.stdout.str()


def test_every_case_passes_and_leaves_no_checkpoint_behind(pytester: pytest.Pytester, refs: Path) -> None:
    artifacts = pytester.path / "artifacts"
    result = run(pytester, refs, "checkpoint", "--gpuregress-keep-runs", f"--gpuregress-artifacts={artifacts}")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines([f"*checkpoint {PLATFORM}: PASSED [[]exact lane[]] 10 steps*",
                                 "*portability: * loaded on cpu: exact lane, logits 0 from the bundle's, * from float64*"])
    assert not list((pytester.path / "checkpoints").iterdir())
    # The kept runs pass again through the command a failure would print: a check case alone, the round trip
    # against its reference.
    assert kept_run_passes(artifacts, "checkpoint-tied", PLATFORM) == 0
    assert kept_run_passes(artifacts, "checkpoint-full-state-dict", PLATFORM, refs / "checkpoint" / PLATFORM) == 0


@pytest.mark.full_tier  # end to end with spawned ranks: the fast tier keeps to its 8 minutes
def test_resume_names_each_piece_a_fault_left_unrestored(pytester: pytest.Pytester, refs: Path) -> None:
    """Three faults in one run (a resume costs three launches, one in new processes): each leaves a
    different piece unrestored, and each piece is named on its own, while the others stay "same"."""
    faults = ("optimizer_dropped", "rng_not_restored", "weights_late")
    result = run(pytester, refs, "resume", *(f"--gpuregress-inject=checkpoint:mode={mode}" for mode in faults))
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    named = {  # the piece -> how its finding reads; each comes from one fault only
        "model": "21 of 21 tensors differ",  # weights_late
        "optimizer.exp_avg": "21 of 21 tensors differ",  # optimizer_dropped
        "optimizer.exp_avg_sq": "21 of 21 tensors differ",
        "optimizer.step": "21 of 21 tensors differ, first lm_head.weight: 5.0 -> 1.0",
        "rng.python": "2 of 2 ranks differ",  # rng_not_restored
        "rng.numpy": "2 of 2 ranks differ",
        "rng.torch_cpu": "2 of 2 ranks differ",
    }
    for piece, how in named.items():
        assert f"[checkpoint] resume: {piece} after the load is not the saved state ({how}" in out, piece
    first = re.search(r"the resumed run differs from the straight run from step (\d+) \(the first step after the resume\)",
                      out)
    assert first is not None and first[1] == "5", out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 4}
    assert rows["lr_scheduler"].endswith("same") and rows["data.position"].endswith("same")
    assert not list((pytester.path / "checkpoints").iterdir())


def test_a_shard_written_from_rank_0_only_is_named(pytester: pytest.Pytester, refs: Path) -> None:
    out = inject(pytester, refs, "full-state-dict or sharded-2to1", "rank0_shard", failed=2)
    sliced = re.search(r"\[checkpoint\] full-state-dict: (\S+) saved with shape (\[[\d, ]+\]), the model's is "
                       r"(\[[\d, ]+\]): the file holds one rank's shard", out)
    assert sliced is not None and sliced.groups() == ("model.embed_tokens.weight", "[128, 64]", "[256, 64]"), out
    failed_load = re.search(r"\[checkpoint\] sharded-(\d)to(\d): loading at world size (\d) failed: ", out)
    assert failed_load is not None and failed_load.groups() == ("2", "1", "1"), out
    assert "/tensors/__1_0.distcp: missing: " in out and "the metadata lists chunks" in out
    assert "fix: every rank must write its shard" in out and "(shared storage)" in out
    assert "Traceback" not in out


def test_chunks_permuted_when_resharding_are_named_both_ways(pytester: pytest.Pytester, refs: Path) -> None:
    out = inject(pytester, refs, "sharded", "chunks_permuted", failed=2)
    named = set(PERMUTED.findall(out))
    for n, m in (("2", "1"), ("1", "2")):
        for piece in ("model", "optimizer.exp_avg", "optimizer.exp_avg_sq"):
            # the case, the piece and tensor, its shape, both world sizes, the chunk order, and both again
            assert (n, m, piece, "model.embed_tokens.weight", "[256, 64]", n, m, "2", "[1, 0]", n, m) in named, piece


def test_a_tied_key_dropped_on_save_is_named(pytester: pytest.Pytester, refs: Path) -> None:
    out = inject(pytester, refs, "tied", "tied_key_dropped", failed=1)
    assert reproduced(out) == [1]  # the printed command judges the kept run as the test did
    dropped = re.search(r"\[checkpoint\] tied: (\S+) is missing from the saved file \(tied: (.+?); none of these "
                        r"names is in the file\)", out)
    assert dropped is not None and dropped.groups() == (TIED[0], " = ".join(TIED)), out
    missing = re.search(r"tensor '(\S+)': missing: the config", out)
    assert missing is not None and missing[1] == TIED[0], out


def test_a_tie_lost_on_load_is_named(pytester: pytest.Pytester, refs: Path) -> None:
    out = inject(pytester, refs, "tied", "untied", failed=1)
    lost = re.search(r"\[checkpoint\] tied: the tie (.+?) is lost after reload: (\d+) tensors \(equal copies\), "
                     r"not one storage", out)
    assert lost is not None and lost.groups() == (" = ".join(TIED), "2"), out


def test_a_one_ulp_nudge_after_load_is_named_by_the_round_trip_and_by_portability(pytester: pytest.Pytester,
                                                                                  refs: Path) -> None:
    out = inject(pytester, refs, "full-state-dict or portability", "ulp_nudge", failed=2)
    nudged = re.search(rf"\[checkpoint\] full-state-dict: {re.escape(NUDGED)} after reload: (\d+) of (\d+) elements "
                       r"differ, first at \(([\d, ]+)\): ", out)
    assert nudged is not None and nudged.groups() == ("1", "4096", "0, 0"), out
    assert f"[checkpoint] portability: {NUDGED}: the tensor the model holds after the load" in out
    assert f"[checkpoint] portability: {NUDGED}: checksum differs" in out


@pytest.mark.full_tier
def test_a_shifted_random_stream_is_data_named_by_its_stream_not_the_checkpoint(pytester: pytest.Pytester,
                                                                                refs: Path) -> None:
    """torch's CPU generator one draw ahead (a release whose stream shifted): the pipeline replaces other tokens,
    the loss curve moves from step 0, and the finding is [data], naming the stream, not [checkpoint]."""
    result = run(pytester, refs, "full-state-dict", "--gpuregress-inject=library:mode=torch_rand_shift")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    batch = re.search(r"\[data\] data: the token batch of step (\d+) differs from the reference's \(its digest\), "
                      r"(\d+) of (\d+) steps' batches do", out)
    assert batch is not None and batch.groups() == ("0", "10", "10"), out
    # On the CPU the device's generator is the CPU's: both streams shifted.
    streams = re.search(r"the data pipeline's random streams drew other numbers: torch's CPU generator \(.+?\) from step "
                        r"(\d+); torch's generator on the device \(.+?\) from step (\d+)", out)
    assert streams is not None and streams.groups() == ("0", "0"), out
    assert "triage verdict: data." in out and "Decided by rule data (" in out
    curve = re.search(r"\[data\] loss curve: this run differs from the reference from step (\d+)", out)
    assert curve is not None and curve[1] == "0", out
    assert "[checkpoint]" not in out and "Python's random generator" not in out


def test_a_damaged_bundle_is_one_clear_error(pytester: pytest.Pytester, refs: Path) -> None:
    tensors = refs / "checkpoint" / PLATFORM / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-100])
    result = run(pytester, refs, "portability")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert f"[checkpoint] portability: {tensors}: sha256 " in out and "does not match manifest.json" in out
    assert "fix: restore it from version control" in out and "re-record it" in out and "Traceback" not in out


@pytest.mark.full_tier
def test_a_curve_that_moves_before_the_save_is_no_checkpoints_doing(pytester: pytest.Pytester, refs: Path) -> None:
    """A collective nudged while training (every step runs before the save): the curve differs, and names nothing
    yet; the round trip of the trained model still holds, so nothing says [checkpoint]."""
    result = run(pytester, refs, "full-state-dict", "--gpuregress-lane=tolerant",
                 "--gpuregress-inject=collective:op=reduce_scatter,mode=scale,rel=1e-2")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert re.search(r"\[unknown\] loss curve: this run differs from the reference from step \d+", out), out
    assert "ran before the checkpoint was saved" in out and "no checkpoint's doing" in out
    assert "[checkpoint]" not in out and "triage verdict: checkpoint" not in out
