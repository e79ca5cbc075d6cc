"""evidence/op_trace_modules.py: where an op of the step-0 trace ran. In forward the module running now, in backward
the module whose forward made the autograd node, an unregistered module labelled from where it ran, FSDP2's unit from
its regions, and the parameter a clipping or optimizer op works on, by storage."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_gpuregress.evidence.op_trace import ROOT
from pytest_gpuregress.evidence.op_trace_modules import LABEL, ModulePaths, ParameterLineage, fsdp_unit, label_graph, tensors_in


class Tiny(nn.Module):
    """inner (Linear, then Tanh) -> head; the head's activation is a module the model does not register."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.Sigmoid()(self.head(self.inner(x)))  # a module made on the fly, as a functional wrapper is


class Where(TorchDispatchMode):
    """Each op's name with the module path ModulePaths gives for it, in forward or backward."""

    def __init__(self, paths: ModulePaths) -> None:
        super().__init__()
        self.paths, self.backward, self.seen = paths, False, []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        where = ModulePaths.backward() if self.backward else self.paths.forward()
        self.seen.append((func.overloadpacket.__name__, where))
        return func(*args, **(kwargs or {}))


def ops_at(seen: list[tuple[str, str]], *names: str) -> dict[str, set[str]]:
    return {name: {where for op, where in seen if op == name} for name in names}


def test_tensors_in_finds_every_tensor_in_nested_outputs() -> None:
    """Tuples, lists and dicts (a ModelOutput) are walked in order; everything else is left out."""
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    found = list(tensors_in((a, [None, {"logits": b, "n": 3}], "text", {"past": (c,)})))
    assert len(found) == 3 and all(x is y for x, y in zip(found, (a, b, c)))
    assert list(tensors_in(5)) == []


@pytest.mark.parametrize(("regions", "unit"), [
    (["FSDP::pre_forward (layers.0)"], "layers.0"),
    (["FSDP::post_backward_reduce for layers.1"], "layers.1"),
    (["FSDP::root_pre_forward"], ROOT),
    (["FSDP::pre_forward (layers.0)", "my region", "FSDP::post_backward_reduce (layers.1)", "inner"], "layers.1"),
    (["my region"], None),
    ([], None),
    (["FSDP:: spaced"], None),
])
def test_fsdp_unit_is_the_innermost_fsdp_regions_unit(regions: list[str], unit: str | None) -> None:
    assert fsdp_unit(regions) == unit


def test_forward_ops_carry_the_running_module_and_backward_ops_the_module_that_made_them() -> None:
    """In forward the innermost module; in backward each grad op the module whose forward built its node; the loss
    outside every module is ""; a module made inside the model's forward is labelled from where it ran."""
    torch.manual_seed(0)
    model = Tiny()
    paths = ModulePaths(model)
    mode = Where(paths)
    paths.install()
    try:
        x = torch.randn(3, 4)
        with mode:
            loss = model(x).sum()
        mode.backward = True
        with mode:
            loss.backward()
    finally:
        paths.remove()
    forward, backward = mode.seen[: len(mode.seen) // 2], mode.seen
    assert ops_at(forward, "addmm", "tanh", "sigmoid", "sum") == {
        "addmm": {"inner.0", "head"}, "tanh": {"inner.1"}, "sigmoid": {"(root).<Sigmoid>"}, "sum": {""}}
    assert ops_at(backward, "tanh_backward", "sigmoid_backward") == {
        "tanh_backward": {"inner.1"}, "sigmoid_backward": {"(root).<Sigmoid>"}}
    assert {where for op, where in backward if op == "mm"} == {"inner.0", "head"}  # the linears' weight and input grads
    assert paths.package_of("head") == "torch" and paths.package_of(ROOT) == "tests"
    assert paths.package_of("") is None and paths.package_of("nowhere") is None


def test_a_module_the_model_does_not_register_is_named_by_its_class_outside_every_module() -> None:
    """Registered modules by their path (the model itself as the root); an unknown one outside any module as
    ``<Class>``, with the package of its code."""
    model = Tiny()
    paths = ModulePaths(model)
    assert paths.name_of(model.head) == "head" and paths.name_of(model.inner[1]) == "inner.1"
    assert paths.name_of(model) == ROOT and paths.forward() == ""
    assert paths.name_of(nn.ReLU()) == "<ReLU>" and paths.package_of("<ReLU>") == "torch"


def test_removed_hooks_see_no_module() -> None:
    """After remove() no module is tracked: forward ops read "", and backward nodes made then carry no label."""
    model = Tiny()
    paths = ModulePaths(model)
    paths.install()
    paths.remove()
    mode = Where(paths)
    with mode:
        out = model(torch.randn(2, 4)).sum()
    assert {where for _, where in mode.seen} == {""}
    assert LABEL not in out.grad_fn.next_functions[0][0].metadata


def test_label_graph_labels_a_modules_nodes_and_stops_at_its_inputs_and_at_other_modules() -> None:
    """Nodes between the outputs and the inputs take the path; a node already labelled inside the path keeps its
    label, and the walk never reaches past the inputs into earlier modules' nodes."""
    x = torch.randn(3, requires_grad=True)
    earlier = x * 2  # an earlier module's output
    earlier.grad_fn.metadata[LABEL] = "layers.0"
    inner = earlier + 1
    inner.grad_fn.metadata[LABEL] = "layers.1.mlp"  # labelled by a submodule's own post-hook first
    out = inner.exp()
    label_graph([out], [earlier], "layers.1")
    assert out.grad_fn.metadata[LABEL] == "layers.1" and inner.grad_fn.metadata[LABEL] == "layers.1.mlp"
    assert earlier.grad_fn.metadata[LABEL] == "layers.0"
    unlabelled = x * 4  # an input made outside every module (the loop's own op)
    label_graph([unlabelled.cos()], [unlabelled], "layers.3")
    assert LABEL not in unlabelled.grad_fn.metadata  # the walk stops at the inputs' nodes
    foreign = x * 3
    foreign.grad_fn.metadata[LABEL] = "layers.5"  # another module's node: the walk stops there
    last = foreign.sin()
    label_graph([last], [], "layers.2")
    assert last.grad_fn.metadata[LABEL] == "layers.2" and foreign.grad_fn.metadata[LABEL] == "layers.5"
    accumulate_x = foreign.grad_fn.next_functions[0][0]  # past both stops: x's own node, never reached
    assert type(accumulate_x).__name__ == "AccumulateGrad" and LABEL not in accumulate_x.metadata


def test_parameter_lineage_names_a_parameter_its_gradient_and_what_ops_made_from_them() -> None:
    """Seeded with the named parameters: the parameter, its gradient and a view of either are its name; a tensor an
    op made from them inherits it; anything else and everything after close() is ""."""
    model = nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    lineage = ParameterLineage()
    lineage.seed(model.named_parameters())
    assert lineage.name([model.weight]) == "weight" and lineage.name([model.bias.grad]) == "bias"
    assert lineage.name([torch.zeros(2), model.weight.grad[0]]) == "weight"  # the first input that has a name
    state = torch.zeros_like(model.weight)  # an optimizer's exp_avg
    assert lineage.name([state]) == ""
    lineage.inherit("weight", [state])
    lineage.inherit("", [torch.zeros(1)])  # an op with no parameter passes nothing on
    assert lineage.name([state]) == "weight"
    lineage.close()
    assert lineage.name([model.weight, state]) == ""
