"""Rank side: loaded state applied to a freshly built trainer, at the two fault points every resume passes.

``apply_model`` and ``apply_optimizer`` (``set_model_state_dict``, ``set_optimizer_state_dict``) are fault
points. Torch is imported inside the functions: only the ranks call them.
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
