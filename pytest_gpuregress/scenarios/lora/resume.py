"""The lora scenario's resume from its reference, on one rank: the save and continue roles
(shared/resume_roles.py) over the trainer rank.py trains (trainer.py), under the case's wrapper.

The checkpoint is what DCP's ``get_state_dict`` gives of the PeftModel (the frozen base weights and the
adapter) and of the torch AdamW under accelerate's wrapper, with the schedule, the generators and the data
position. No LoRA check runs here: the continuation is judged against the reference's last steps only.
"""

from __future__ import annotations

from ...reference.record import RunRecord
from ..base import RankContext
from ..shared.resume_roles import Roles
from .trainer import build

ROLES = Roles("lora", build)


def run(ctx: RankContext) -> RunRecord:
    return ROLES.run(ctx)
