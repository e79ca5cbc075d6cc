"""The noise envelope: measured spreads, limits of K x spread + floor, and the signed weight checksum."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pytest_gpuregress.comparison import envelope
from pytest_gpuregress.comparison.compare import compare_training
from pytest_gpuregress.comparison.report import format_stack_changes
from pytest_gpuregress.reference.record import float_digest

from ..conftest import make_record


def _perturbed(rel: float, seed: int = 1):  # type: ignore[no-untyped-def]
    run = make_record()
    rng = np.random.default_rng(seed)
    run.series["loss"] = [x * (1 + rel * rng.uniform(-1, 1)) for x in run.series["loss"]]
    run.series["grad_norm"] = [x * (1 + rel * rng.uniform(-1, 1)) for x in run.series["grad_norm"]]
    run.arrays["param_grad_norm"] = run.arrays["param_grad_norm"] * (1 + rel)
    for key in ("step0_grad/a.weight", "step0_grad/b.weight"):
        run.arrays[key] = (run.arrays[key].astype(np.float64) * (1 + rel)).astype(np.float32)
    return run


def _with_envelope(rel: float):  # type: ignore[no-untyped-def]
    base = make_record()
    base.arrays.update(envelope.measure(base, [_perturbed(rel, 1), _perturbed(rel, 2)]))
    return base


def test_the_spread_never_shrinks_along_the_steps() -> None:
    base = make_record()
    spread = envelope.measure(base, [_perturbed(1e-6)])
    for metric in ("loss", "grad_norm"):
        values = spread[envelope.PREFIX + metric]
        assert values.shape == (base.steps,) and (np.diff(values) >= 0).all() and values.max() > 0
    assert spread[envelope.PREFIX + "param_grad_norm"].shape == base.arrays["param_grad_norm"].shape
    assert spread[envelope.PREFIX + "step0_grad"].shape == (2,)


def test_a_deviation_inside_k_times_the_spread_passes_and_one_beyond_fails() -> None:
    reference = _with_envelope(1e-6)
    inside = compare_training(reference, _perturbed(2e-6, seed=3), lane="tolerant")
    assert inside.passed and inside.limits_from == "envelope"
    assert 0 < max(inside.margins.values()) < 1
    beyond = compare_training(reference, _perturbed(1e-4, seed=3), lane="tolerant")
    assert not beyond.passed
    assert {f.metric for f in beyond.findings} >= {"loss", "step0_grad"}
    assert max(beyond.margins.values()) > 1


def test_without_an_envelope_the_fixed_limits_apply() -> None:
    comparison = compare_training(make_record(), _perturbed(1e-7), lane="tolerant")
    assert comparison.passed and comparison.limits_from == "fixed"


def test_a_weight_tensor_with_flipped_sign_fails_the_tolerant_lane() -> None:
    weights = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    reference, run = make_record(), make_record()
    reference.digests = {"a.weight": float_digest(weights)}
    run.digests = {"a.weight": float_digest(-weights)}
    assert float_digest(weights)["abs_sum"] == float_digest(-weights)["abs_sum"]  # |w| alone cannot see it
    comparison = compare_training(reference, run, lane="tolerant")
    finding = next(f for f in comparison.findings if f.metric == "final_weights")
    assert finding.tensor == "a.weight"


def test_a_permutation_of_weights_fails_the_tolerant_lane() -> None:
    weights = np.random.default_rng(0).normal(size=256).astype(np.float32)
    reference, run = make_record(), make_record()
    reference.digests = {"w": float_digest(weights)}
    run.digests = {"w": float_digest(np.roll(weights, 128))}  # two chunks swapped: same sum and |sum|
    assert not compare_training(reference, run, lane="tolerant").passed


def test_every_library_version_change_only_chooses_the_lane_and_is_named() -> None:
    reference, run = make_record(), make_record()
    versions = {"torch": "2.14.1", "transformers": "5.23.0", "peft": "0.20.0", "accelerate": "1.14.0"}
    run.fingerprint = {**run.fingerprint, "versions": {**run.fingerprint["versions"], **versions}}
    reference.fingerprint["versions"].update({"transformers": "5.24.0", "peft": "0.21.2", "accelerate": "1.15.0"})
    comparison = compare_training(reference, run)
    assert comparison.lane == "tolerant" and comparison.passed
    lines = "\n".join(format_stack_changes(comparison.stack_changes))
    for line in ("torch 2.13.0 -> 2.14.1", "transformers 5.24.0 -> 5.23.0", "peft 0.21.2 -> 0.20.0",
                 "accelerate 1.15.0 -> 1.14.0"):
        assert line in lines
    assert "transformers 5.24.0 -> 5.23.0" in comparison.lane_reason


def test_the_cpu_core_count_is_not_in_the_numerics_key() -> None:
    from pytest_gpuregress.stack.fingerprint import numerics_diff

    a = {"device": {"kind": "cpu", "cpu_count": 2, "count": None}}
    b = {"device": {"kind": "cpu", "cpu_count": 64, "count": None}}
    assert numerics_diff(a, b) == []


def test_a_replica_that_goes_non_finite_refuses_the_envelope() -> None:
    import pytest

    broken = make_record()
    broken.series["loss"][2] = float("nan")
    with pytest.raises(envelope.NoisyReplica, match="non-finite loss"):
        envelope.measure(make_record(), [broken])


def test_a_nan_fails_the_tolerant_lane_even_inside_an_envelope() -> None:
    run = make_record()
    run.series["loss"][3] = float("nan")
    comparison = compare_training(_with_envelope(1e-3), run, lane="tolerant")
    assert any(f.metric == "loss" and f.step == 3 for f in comparison.findings)


def test_one_flipped_element_of_a_large_tensor_fails_the_tolerant_lane() -> None:
    weights = np.random.default_rng(1).normal(size=200_000).astype(np.float32)
    flipped = weights.copy()
    flipped[12345] = -flipped[12345]
    reference, run = make_record(), make_record()
    reference.digests = {"w": float_digest(weights)}
    run.digests = {"w": float_digest(flipped)}
    assert not compare_training(reference, run, lane="tolerant").passed


def test_a_kernel_path_this_stack_cannot_run_is_left_out_of_the_envelope_with_the_reason(tmp_path: Path) -> None:
    """torch 2.13 on an AMX CPU forced to AVX2 raises in bf16 attention: that path is not the stack's own, so the
    envelope comes from the other replicas; a replica without an environment of its own that fails still fails."""
    from types import SimpleNamespace

    import pytest

    from pytest_gpuregress.errors import RankFailure
    from pytest_gpuregress.plugin.launches import Launches
    from pytest_gpuregress.plugin.options import Options
    from pytest_gpuregress.scenarios import Launch, Setup, get_scenario
    from pytest_gpuregress.stack.platforms import Platform
    from pytest_gpuregress.training import noise

    def launch(sc: object, replica: Launch, faults: list[str]) -> object:
        if replica.env:
            raise RankFailure("rank 0 raised RuntimeError\nTraceback ...\nRuntimeError: pack_vnni2 is only supported "
                              "when avx512 is supported")
        return make_record(seed=len(replica.key))

    def every_launch_fails(sc: object, replica: Launch, faults: list[str]) -> object:
        raise RankFailure("rank 1 died")

    platform = Platform("cpu", "gloo", 2, "cpu", "cpu", False)
    launches = Launches(Options(replicas=3), platform, Setup("cpu", "gloo", 2), SimpleNamespace(), tmp_path)  # type: ignore[arg-type]
    launches.launch = launch  # type: ignore[method-assign]
    reference = make_record()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(noise, "lower_cpu_capability", lambda: "avx2")
        launches.add_envelope(get_scenario("fsdp"), Launch("main", {}), reference, [])
    assert reference.results["envelope"]["replicas"] == ["replica-weights_ulp_up", "replica-reduction_order"]
    (note,) = [n for n in reference.notes if "left out" in n]
    assert "ATEN_CPU_CAPABILITY=avx2" in note and "RuntimeError: pack_vnni2" in note
    def kernel_path_crashes(sc: object, replica: Launch, faults: list[str]) -> object:
        if replica.env:
            raise RankFailure("rank 0 died with SIGSEGV before delivering results")
        return make_record(seed=len(replica.key))

    launches.launch = kernel_path_crashes  # type: ignore[method-assign]
    with pytest.raises(RankFailure, match="SIGSEGV"):  # a crash on the lower path is no lacking instruction set
        launches.add_envelope(get_scenario("fsdp"), Launch("main", {}), make_record(), [])
    launches.launch = every_launch_fails  # type: ignore[method-assign]
    with pytest.raises(RankFailure, match="rank 1 died"):
        launches.add_envelope(get_scenario("fsdp"), Launch("main", {}), make_record(), [])


def _weights_record(weights: np.ndarray) -> object:
    record = make_record()
    record.digests = {"w": float_digest(weights)}
    return record


def test_a_systematic_magnitude_change_fails_inside_the_chaotic_spread_of_the_signed_sums() -> None:
    """A weight decay skipped grows |w| by about 1% while bf16 chaos moves each element (and so the signed sums) by
    about 2% of |w| and their sum of |w| by far less: final_weights' own envelope is too wide to see it, the magnitude's own
    envelope is not. A reference without that envelope holds magnitudes to final_weights' limit, as before."""
    rng = np.random.default_rng(0)
    weights = rng.normal(size=2048)
    base = _weights_record(weights)
    replicas = [_weights_record(weights + 0.02 * np.abs(weights) * rng.choice([-1.0, 1.0], size=weights.size))
                for _ in range(3)]
    spread = envelope.measure(base, replicas)
    assert spread[envelope.PREFIX + envelope.MAGNITUDE][0] < 0.1 * spread[envelope.PREFIX + "final_weights"][0]
    base.arrays.update(spread)
    chaotic = _weights_record(weights + 0.02 * np.abs(weights) * rng.choice([-1.0, 1.0], size=weights.size))
    assert compare_training(base, chaotic, lane="tolerant").passed
    decay_skipped = _weights_record(weights * 1.01 + 0.02 * np.abs(weights) * rng.choice([-1.0, 1.0], size=weights.size))
    failed = compare_training(base, decay_skipped, lane="tolerant")
    [finding] = failed.findings
    assert (finding.metric, finding.tensor) == ("final_weights", "w")
    assert finding.distance == pytest.approx(0.01, rel=0.2) and finding.tolerance < finding.distance
    older = _weights_record(weights)
    older.arrays.update({k: v for k, v in spread.items() if not k.endswith(envelope.MAGNITUDE)})
    assert compare_training(older, decay_skipped, lane="tolerant").passed  # final_weights' limit: too wide to see it
