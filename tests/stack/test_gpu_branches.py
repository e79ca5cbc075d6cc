"""Branches taken only on CUDA or ROCm, executed on a CPU build (docs/gpu.md lists them all).

Each test reaches a GPU-only branch by an honest seam: torch.cuda and torch.version.hip patched to what a
GPU build reports, a recorded /proc line, or the bf16 dtype a GPU config trains in. What only a real GPU
can show (kernels, NCCL, memory) stays listed as such in docs/gpu.md."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from pytest_gpuregress.comparison import envelope
from pytest_gpuregress.comparison.compare import DEFAULT_TOLERANCES, compare_training, tolerant_limits
from pytest_gpuregress.errors import BadModel, UnsupportedPlatform
from pytest_gpuregress.scenarios import registry
from pytest_gpuregress.scenarios.base import Setup
from pytest_gpuregress.scenarios.formats import SCENARIO as FORMATS_SCENARIO
from pytest_gpuregress.scenarios.formats import scaled_mm
from pytest_gpuregress.stack import fingerprint as fp
from pytest_gpuregress.stack.platforms import resolve_platform
from pytest_gpuregress.training import model_specs, noise
from pytest_gpuregress.training.noise import apply_switches
from pytest_gpuregress.triage.flips import switches

from ..conftest import make_record

CUDA8 = Setup("cuda", "nccl", 8)


def as_gpu_build(monkeypatch: pytest.MonkeyPatch, *, hip: str | None = None, count: int = 8,
                 capability: tuple[int, int] = (9, 0), arch: str = "gfx942:sramecc+:xnack-") -> None:
    """torch as a CUDA (or, with ``hip``, ROCm) build reports itself on a machine with ``count`` GPUs."""
    props = SimpleNamespace(major=capability[0], minor=capability[1], gcnArchName=arch, total_memory=80 << 30)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)
    for name in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "GPUREGRESS_SPAWNED"):  # not under torchrun or srun
        monkeypatch.delenv(name, raising=False)


# --- platform keys ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("hip", "key"), [(None, "cuda-sm_90-nccl-w8-bf16"), ("6.4.43482", "rocm-gfx942-nccl-w8-bf16")])
def test_a_gpu_machine_resolves_to_its_vendor_arch_and_bf16_key(monkeypatch: pytest.MonkeyPatch, hip: str | None,
                                                                key: str) -> None:
    as_gpu_build(monkeypatch, hip=hip)
    platform = resolve_platform("auto")
    assert (platform.device_kind, platform.backend, platform.world_size) == ("cuda", "nccl", 8)
    fsdp = registry()["fsdp"]
    setup = Setup(platform.device_kind, platform.backend, platform.world_size)
    assert platform.key(fsdp.platform_tag(fsdp.default_config(setup))) == key  # as benchmarks/gpu_check.sh computes it


def test_more_ranks_than_gpus_and_a_gpu_build_without_a_gpu_are_refused_naming_the_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    as_gpu_build(monkeypatch, count=2)
    with pytest.raises(UnsupportedPlatform, match="world-size 3: only 2 GPUs are visible"):
        resolve_platform("auto", 3)
    as_gpu_build(monkeypatch, hip="6.4.43482", count=0)
    with pytest.raises(UnsupportedPlatform, match=r"\(ROCm build\) sees no GPU"):
        resolve_platform("cuda")


def test_gpu_configs_train_the_gpu_model_in_bf16() -> None:
    for name in ("fsdp", "lora"):
        config = registry()[name].default_config(CUDA8)
        assert (config["dtype"], config["model_size"]) == ("bf16", "gpu")


# --- bf16 limits -------------------------------------------------------------------------------------

def _bf16(record: Any) -> Any:
    record.config = {**record.config, "dtype": "bf16"}
    return record


def test_a_bf16_reference_allows_one_bf16_ulp_where_its_replicas_agreed() -> None:
    reference = _bf16(make_record())
    reference.arrays.update(envelope.measure(reference, [make_record()]))  # replicas equal to it: zero spread
    limits, source = tolerant_limits(reference)
    assert source == "envelope" and np.all(limits["loss"] == envelope.FLOORS["bf16"].loss) and limits["loss"][0] == 4e-3
    run = make_record()
    run.series["loss"] = [x * (1 + 2e-3) for x in run.series["loss"]]  # half a bf16 ulp: rounding, not a fault
    assert compare_training(reference, run, lane="tolerant").passed
    fp32 = make_record()
    fp32.arrays.update(envelope.measure(fp32, [make_record()]))
    assert not compare_training(fp32, run, lane="tolerant").passed  # the same drift is 8000 fp32 ulps


def test_a_bf16_reference_without_replicas_gets_the_fixed_bf16_limits() -> None:
    limits, source = tolerant_limits(_bf16(make_record()))
    assert source == "fixed" and limits["loss"][0] == DEFAULT_TOLERANCES["bf16"].loss


def test_the_weight_replica_of_a_bf16_run_moves_each_weight_one_bf16_step() -> None:
    # No powers of two: going down from one, one ulp of its binade (the replica's step) is two bf16 steps.
    weights = torch.tensor([1.5, -3.0, 0.375, 1000.0])
    for up in (True, False):
        nudged = weights.clone()
        assert noise.perturb_weights([nudged], "weights_ulp_up" if up else "weights_ulp_down", "bf16")
        assert torch.equal(nudged.bfloat16().float(), nudged)  # still a bf16 value: the cast to bf16 keeps it
        steps = nudged.bfloat16().view(torch.int16).int() - weights.bfloat16().view(torch.int16).int()
        assert torch.equal(steps.abs(), torch.ones(4, dtype=torch.int32))
        assert torch.equal(nudged > weights, torch.full((4,), up))


def test_the_gpu_kernel_path_replica_needs_no_environment_of_its_own() -> None:
    # On GPUs it switches the BLAS library on the rank (apply_kernel_path), so its ranks can be the pool's.
    plan = dict(noise.replica_plan(3, "cuda"))
    assert any("kernel_path" in p for p in plan) and all(env == {} for env in plan.values())


# --- fp8 matmul, triage switches, fingerprint, memory ---------------------------------------------------

@pytest.mark.parametrize(("hip", "capability", "arch", "expected"), [
    (None, (9, 0), "", "e4m3fn"), (None, (8, 9), "", "e4m3fn"), (None, (8, 0), "", None),
    ("6.4", (9, 4), "gfx942:sramecc+:xnack-", "e4m3fnuz"), ("7.0", (9, 5), "gfx950", "e4m3fn"),
    ("6.4", (9, 0), "gfx90a:sramecc+:xnack-", None)])
def test_the_fp8_matmul_format_follows_the_gpu_arch(monkeypatch: pytest.MonkeyPatch, hip: str | None,
                                                    capability: tuple[int, int], arch: str, expected: str | None) -> None:
    as_gpu_build(monkeypatch, hip=hip, capability=capability, arch=arch)
    fmt, why = scaled_mm.fp8_matmul_format("cuda:0")
    assert (fmt.id if fmt else None) == expected, why
    if fmt is None:
        assert "has no fp8 matrix multiply" in why


def test_the_formats_scenario_adds_its_scaled_mm_case_on_gpus_only() -> None:
    assert "scaled_mm" in {c.id for c in FORMATS_SCENARIO.cases(CUDA8)}
    assert FORMATS_SCENARIO.header(CUDA8) == []  # the "not applicable on the cpu" line is the CPU's alone


def test_triage_flips_nccl_protocol_algorithm_blas_sdpa_and_reductions_on_gpus() -> None:
    flips = {s.label: s for s in switches(CUDA8)}
    assert flips["NCCL_PROTO=Simple"].env == {"NCCL_PROTO": "Simple"} and flips["NCCL_ALGO=Ring"].env == {"NCCL_ALGO": "Ring"}
    assert flips["the other BLAS library"].config == {"blas_library": "other"}
    assert flips["TF32 off"].not_applicable and "world size 1" not in flips


def test_the_gpu_switches_set_sdpa_math_and_reductions_off_and_undo_them() -> None:
    cuda = torch.backends.cuda
    before = (cuda.flash_sdp_enabled(), cuda.math_sdp_enabled(), cuda.matmul.allow_bf16_reduced_precision_reduction)
    ctx = SimpleNamespace(device_kind="cuda", cleanup_hooks=[])
    apply_switches({"sdpa_backend": "math", "reduced_precision_reduction": False}, ctx)
    try:
        assert not cuda.flash_sdp_enabled() and cuda.math_sdp_enabled()
        assert not cuda.matmul.allow_bf16_reduced_precision_reduction
    finally:
        for hook in ctx.cleanup_hooks:
            hook()
    assert (cuda.flash_sdp_enabled(), cuda.math_sdp_enabled(), cuda.matmul.allow_bf16_reduced_precision_reduction) == before


def test_the_nccl_version_and_the_kernel_drivers_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    as_gpu_build(monkeypatch)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    assert fp._nccl_version(torch) == "2.27.3"
    proc = tmp_path / "version"  # /proc/driver/nvidia/version, as the 535 driver writes it
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
                    "GCC version:  gcc version 11.4.0\n")
    assert fp._read_first(str(proc)) == "535.104.05"
    asked: list[str] = []
    monkeypatch.setattr(fp, "_read_first", lambda path: asked.append(path))
    fp._driver_version(torch)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    fp._driver_version(torch)
    assert asked == ["/proc/driver/nvidia/version", "/sys/module/amdgpu/version"]


def test_a_model_too_large_for_one_gpu_is_refused_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    as_gpu_build(monkeypatch)  # 8 GPUs of 80 GiB
    assert model_specs.available_memory("cuda") == 80 << 30
    model_specs._check_size("small", 1_000_000_000, "cuda", 8)  # 1 B params: 4 GiB of replica per GPU fits
    with pytest.raises(BadModel, match="for each GPU"):
        model_specs._check_size("huge", 30_000_000_000, "cuda", 8)


def test_the_checkpoint_keeps_the_gpu_generator_state_through_a_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpuregress.training import rng_state as rng

    device_state = torch.Generator().manual_seed(7).get_state()  # a uint8 state, as torch.cuda's is
    restored: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: device_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    states = rng.capture("cuda")
    rng.restore(states, "cuda")
    assert torch.equal(restored[0], device_state)
    assert "torch_device" not in rng.capture("cpu")
