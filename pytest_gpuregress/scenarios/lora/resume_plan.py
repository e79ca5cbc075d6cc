"""Session side of the lora scenario's resume from its reference: one resume case per wrapper
(``lora-fully_shard-resume``, ``lora-accelerate-resume``), each judging its wrapper's reference, and what the
checkpoint weighs on GPUs. What a recording stores, the launch that continues and the comparator are
fsdp-resume's (shared/resume_plan.py); the rank side is resume.py. torch-free.
"""

from __future__ import annotations

from ...training.models import TINY_LLAMA_GPU_PARAMETERS
from ..base import Case
from ..shared.resume_plan import PART, ResumePlan

ENTRY = "pytest_gpuregress.scenarios.lora.resume:run"
GPU_MODEL_PARAMETERS = TINY_LLAMA_GPU_PARAMETERS  # frozen in fp32
GPU_ADAPTER_PARAMETERS = 1_163_264  # r 8 on its 7 projections in 8 layers: 8 x (in + out) per projection
GPU_BYTES = 4 * GPU_MODEL_PARAMETERS + 12 * GPU_ADAPTER_PARAMETERS  # the adapter with AdamW's two moments

PLAN = ResumePlan(ENTRY, "the frozen base weights, 4 bytes per parameter, and the adapter with AdamW's two "
                         f"moments: about {GPU_BYTES / 1e9:.2f} GB for the 156 M-parameter model")


def resume_case(case_id: str, wrapper: str) -> Case:
    """The resume case of the wrapper case ``case_id``: its launch and reference, its id with ``-resume``."""
    return Case(f"{case_id}-resume", launch=wrapper, data={"wrapper": wrapper, "model": None, "part": PART})
