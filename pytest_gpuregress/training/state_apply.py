"""Rank side: loaded state applied to a freshly built trainer, at the two fault points every resume passes.

``apply_model`` puts loaded weights into the model, ``apply_optimizer`` loaded state into the optimizer
(``set_model_state_dict`` and ``set_optimizer_state_dict``, as FSDP2 users do). They are fault points
(fault_points.py): faults/checkpoint.py drops the optimizer state or applies the weights a step late
here, in the checkpoint scenario's resume and in the fsdp scenario's resume from its reference alike.
Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..fault_points import fault_point


class Trainable(Protocol):
    """A model and its optimizer: what loaded state is applied to."""

    model: Any

    @property
    def optimizer(self) -> Any: ...


@fault_point("checkpoint.apply_model")
def apply_model(trainer: Trainable, model_state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(trainer.model, model_state)


@fault_point("checkpoint.apply_optimizer")
def apply_optimizer(trainer: Trainable, optim_state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state)
