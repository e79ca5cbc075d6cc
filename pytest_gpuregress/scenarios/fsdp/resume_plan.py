"""Session side of the fsdp scenario's resume from its reference: the case ``fsdp-resume`` and what its checkpoint
weighs on GPUs. What a recording stores, the launch that continues and the comparator are shared
(shared/resume_plan.py); the rank side is resume.py. torch-free.
"""

from __future__ import annotations

from ..base import Case
from ..shared.resume_plan import PART, ResumePlan
from .resume import ENTRY

CASE = Case("resume", data={"part": PART})  # launch "default": recording it records the fsdp reference itself
GPU_BYTES_PER_PARAMETER = 12  # fp32 weights, exp_avg and exp_avg_sq (FSDP2 keeps fp32 shards under bf16 compute)
GPU_MODEL_PARAMETERS = 155_730_944  # the tiny Llama at GPU size (models/tiny-llama/gpu)

PLAN = ResumePlan(ENTRY, "weights and AdamW's two moments, 12 bytes per parameter: about "
                         f"{GPU_BYTES_PER_PARAMETER * GPU_MODEL_PARAMETERS / 1e9:.1f} GB for the 156 M-parameter model")
