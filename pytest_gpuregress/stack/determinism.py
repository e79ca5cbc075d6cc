"""Every determinism switch in one place (after torchtitan's ``set_determinism``).

Called on every rank before a scenario builds anything. What it set is returned and stored in
the fingerprint, so a reference says under which switches it was recorded.
"""

from __future__ import annotations

import os
import random
from typing import Any


def set_determinism(seed: int, *, device_kind: str, cpu_threads: int | None = 1) -> dict[str, Any]:
    """Seed every generator and force deterministic kernels; return what was set.

    ``cpu_threads``: intra-op threads per rank. One thread per rank keeps CPU reductions in a fixed
    order (a different thread count changes float sums) and stops two ranks fighting over cores.
    """
    import numpy as np
    import torch

    # cuBLAS needs this before the first cuBLAS handle is created to be deterministic.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if device_kind == "cuda":
        torch.cuda.manual_seed_all(seed)
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    # Process-wide numerics a previous job in a reused rank may have changed: back to torch's defaults.
    torch.set_default_dtype(torch.float32)
    torch.set_flush_denormal(False)
    for backend in ("flash", "mem_efficient", "math"):
        getattr(torch.backends.cuda, f"enable_{backend}_sdp")(True)
    # Strict on the CPU. On GPUs some kernels (flash/mem-efficient SDPA backward) have no
    # deterministic variant and would raise; warn_only keeps deterministic choices where they exist.
    torch.use_deterministic_algorithms(True, warn_only=device_kind == "cuda")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # TF32 silently lowers fp32 matmul precision on Ampere+ and its default moved between releases.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return {
        "seed": seed,
        "cpu_threads": cpu_threads,
        "deterministic_algorithms": True,
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "tf32": False,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
