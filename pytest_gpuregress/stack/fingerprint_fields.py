"""Every field of the stack fingerprint, declared once: its section, what it is, and which judgements read it.

No field can make a reference foreign; ``exact`` fields choose the lane (why some are not: docs/envelope.md).
``markdown_table()`` is docs/known_issues.md's table, and tests keep it and ``collect()`` equal to FIELDS. Torch-free.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Section = Literal["versions", "device", "numerics", "comm", "packages"]
SECTIONS: tuple[Section, ...] = ("versions", "device", "numerics", "comm", "packages")


@dataclass(frozen=True)
class Field:
    section: Section
    name: str
    meaning: str = ""  # for the docs' table: values it takes, where that helps
    exact: bool = False  # a change can move a computed number on the same inputs: leaves the exact lane
    hardware: bool = False  # which hardware ran: perf figures compare only where these agree
    software: bool = False  # what a platform team upgrades: a one-line summary of changes never drops it
    probed: bool = False  # read from the device's own tools (devices.probe_device); None on a CPU
    matchable: bool = True  # a known issue may name it (comm.env.* and numerics.determinism.* by prefix)
    on_cpu: bool = True  # recorded on a CPU run too (the GPU runtime's versions are not)

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


def _versions(*names: str, exact: bool) -> tuple[Field, ...]:
    return tuple(Field("versions", name, exact=exact, software=True) for name in names)


FIELDS: tuple[Field, ...] = (
    *_versions("torch", "transformers", "peft", "accelerate", "numpy", exact=True),
    *_versions("safetensors", "python", "pytest_gpuregress", exact=False),
    Field("device", "kind", "`cpu` / `cuda`, ROCm included", exact=True, hardware=True),
    Field("device", "name", "e.g. `AMD Instinct MI355X`, `NVIDIA H100 80GB HBM3`", exact=True, hardware=True),
    Field("device", "count", "accelerators; None on a CPU", exact=True, hardware=True),
    Field("device", "arch", "`gfx950`, `sm_90`, or the CPU's machine", exact=True, hardware=True),
    Field("device", "cuda", exact=True, software=True, on_cpu=False),
    Field("device", "hip", exact=True, software=True, on_cpu=False),
    Field("device", "driver", exact=True, software=True, on_cpu=False),
    Field("device", "dnn", "`cuDNN 9.1.0` / `MIOpen 3.2.0`", exact=True, software=True, probed=True),
    Field("device", "blas_library", "`cuBLAS`, `cuBLASLt`, `rocBLAS`, `hipBLASLt`, `CK`", exact=True,
          software=True, probed=True),
    Field("device", "mig", hardware=True, probed=True),
    Field("device", "firmware", probed=True),
    Field("device", "cpu_model", exact=True, hardware=True),
    Field("device", "cpu_capability", "ATen's CPU kernel path: `AVX512`, `AVX2`, `DEFAULT`", exact=True, hardware=True),
    Field("device", "cpu_bf16", "bf16 runs on a CPU (only): `amx_bf16`, `avx512_bf16` or `none`", exact=True),
    Field("device", "cpu_count"),
    Field("device", "machine", hardware=True),
    *(Field("numerics", name, exact=True) for name in (
        "blas", "sdpa_backends", "tf32_matmul", "tf32_cudnn", "float32_matmul_precision",
        "bf16_reduced_precision_reduction", "fp16_reduced_precision_reduction", "deterministic_algorithms",
        "cudnn_deterministic", "cudnn_benchmark", "cublas_workspace_config", "num_threads")),
    Field("comm", "backend", "`nccl` / `gloo`", exact=True),
    Field("comm", "world_size", exact=True),
    Field("comm", "nccl_version", "RCCL's version on ROCm builds", exact=True, software=True),
    Field("comm", "rccl", "whether torch is a ROCm build"),
    Field("comm", "env", "the collective and kernel libraries' settings, matched as `env.NAME`", exact=True,
          matchable=False),
)

# Environment variables recorded in comm.env: those that can change a collective's or a kernel's numbers.
COMM_ENV_PREFIXES = ("NCCL_", "RCCL_", "HSA_", "GLOO_", "TORCH_NCCL_", "TORCH_FR_", "ATEN_CPU_CAPABILITY", "MKL_",
                     "ONEDNN_", "DNNL_")
# Settings that route sockets, log, dump, time or handle errors but change no computed number: the plugin arms
# torch's flight recorder itself (launch/torch_trace.py), so recording those would match no two runs.
COMM_ENV_IGNORED = frozenset({
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "TORCH_NCCL_DESYNC_DEBUG", "ONEDNN_VERBOSE", "DNNL_VERBOSE", "ONEDNN_JIT_DUMP", "DNNL_JIT_DUMP",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_ENABLE_TIMING", "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "TORCH_NCCL_COORD_CHECK_MILSEC", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
    "TORCH_NCCL_EXTRA_DUMP_ON_EXEC", "TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN", "TORCH_NCCL_RETHROW_CUDA_ERRORS",
    "TORCH_NCCL_PROPAGATE_ERROR", "TORCH_NCCL_CUDA_EVENT_CACHE",
})
# The same kinds of setting by their names' parts, for variables the lists above do not know yet; no setting that
# changes numbers (NCCL_PROTO, MKL_CBWR...) has one. Timeouts stay: a known issue of a hang may name one.
COMM_ENV_IGNORED_PARTS = ("_FILE", "_DIR", "_PATH", "DEBUG", "_LOG", "TRACE", "DUMP", "TIMING", "VERBOSE",
                          "SOCKET_IFNAME", "MONITORING", "HEARTBEAT")


def recorded_env(name: str) -> bool:
    """Whether comm.env records the environment variable ``name``: one that can change a number (COMM_ENV_PREFIXES),
    unless it only routes, logs, dumps or times (COMM_ENV_IGNORED, COMM_ENV_IGNORED_PARTS)."""
    return name.startswith(COMM_ENV_PREFIXES) and name not in COMM_ENV_IGNORED \
        and not any(part in name for part in COMM_ENV_IGNORED_PARTS)


# ``packages`` records every installed distribution; the exact lane keys only on those that can change a computed
# number: kernels of their own or replacements of the stack's (a tokenizer or a logger that moved keeps the lane).
COMPUTE_PACKAGES = frozenset({
    "kernels", "triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu", "flash-attn", "flash-attn-3",
    "flashinfer-python", "liger-kernel", "xformers", "apex", "bitsandbytes", "torchao", "deepspeed", "megatron-core",
    "mamba-ssm", "causal-conv1d", "unsloth", "unsloth-zoo", "cut-cross-entropy", "fbgemm-gpu", "fbgemm-gpu-genai",
    "intel-extension-for-pytorch", "torch-tensorrt", "tensorrt", "aiter", "quack-kernels", "mkl", "intel-openmp",
    "ml-dtypes", "torchtitan", "torchtune", "opt-einsum",
})
# And by a prefix: NVIDIA's CUDA libraries as wheels (a pip-installed CUDA torch computes with them), Transformer
# Engine's parts, ROCm's wheels.
COMPUTE_PREFIXES = ("nvidia-", "transformer-engine", "flash-attn", "rocm-", "triton-")


def computes(package: str) -> bool:
    """Whether a distribution (by its normalized name) can change a computed number, for the exact lane."""
    return package in COMPUTE_PACKAGES or package.startswith(COMPUTE_PREFIXES)


PREFIXED = {"numerics": "determinism.", "comm": "env.", "packages": ""}  # fields whose names are open, matched by prefix


def names(section: Section, **flags: bool) -> tuple[str, ...]:
    """The names of ``section``'s fields whose flags are as given: ``names("device", exact=True)``."""
    return tuple(f.name for f in FIELDS if f.section == section and all(getattr(f, k) == v for k, v in flags.items()))


NUMERICS_FIELDS: dict[str, tuple[str, ...]] = {section: names(section, exact=True) for section in SECTIONS}
HARDWARE_FIELDS = names("device", hardware=True)
PROBED_FIELDS = names("device", probed=True)
SOFTWARE_KEYS = tuple(f.key for f in FIELDS if f.software)
MATCHABLE: dict[str, frozenset[str]] = {section: frozenset(names(section, matchable=True)) for section in SECTIONS}

BEGIN, END = "<!-- fingerprint-fields:begin -->", "<!-- fingerprint-fields:end -->"


def markdown_table() -> list[str]:
    """docs/known_issues.md's table of fields: what each is and which judgements read it."""
    def mark(on: bool) -> str:
        return "yes" if on else ""

    lines = ["| field | what it is | exact lane | perf hardware | upgrade |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{f.key}` | {f.meaning} | {mark(f.exact)} | {mark(f.hardware)} | {mark(f.software)} |" for f in FIELDS]
    what = {"numerics": "determinism settings", "comm": "one setting",
            "packages": "one installed distribution's version (every one; the exact lane: those that compute)"}
    lines += [f"| `{section}.{prefix}NAME` | {what[section]} | yes |  | {'yes' if section == 'packages' else ''} |"
              for section, prefix in PREFIXED.items()]
    return lines


def main(argv: list[str]) -> int:
    """Rewrite the table in the given markdown file: python -m pytest_gpuregress.stack.fingerprint_fields FILE."""
    path = Path(argv[0])
    text = path.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(text[:start] + "\n" + "\n".join(markdown_table()) + "\n" + text[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
