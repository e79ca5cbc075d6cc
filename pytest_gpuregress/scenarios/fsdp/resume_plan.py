"""Session side of the fsdp scenario's resume from its reference: the case ``fsdp-resume`` and what its checkpoint
weighs on GPUs. What a recording stores, the launch that continues and the comparator are shared
(shared/resume_plan.py); the rank side is rank.py's ``resume``. torch-free.
"""

from __future__ import annotations

from ...training.models import TINY_LLAMA_GPU_PARAMETERS
from ..base import Case
from ..shared.resume_plan import PART, ResumePlan

ENTRY = "pytest_gpuregress.scenarios.fsdp.rank:resume"

CASE = Case("resume", data={"part": PART})  # launch "default": recording it records the fsdp reference itself
GPU_BYTES_PER_PARAMETER = 12  # fp32 weights, exp_avg and exp_avg_sq (FSDP2 keeps fp32 shards under bf16 compute)
GPU_MODEL_PARAMETERS = TINY_LLAMA_GPU_PARAMETERS

PLAN = ResumePlan(ENTRY, "weights and AdamW's two moments, 12 bytes per parameter: about "
                         f"{GPU_BYTES_PER_PARAMETER * GPU_MODEL_PARAMETERS / 1e9:.1f} GB for the 156 M-parameter model")
