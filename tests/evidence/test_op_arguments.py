"""evidence/op_arguments.py: an op called with other scalars, or from another package, shows in the trace."""

from __future__ import annotations

import torch

from pytest_gpuregress.evidence.op_arguments import arguments_text, calling_package, module_package


def test_the_non_tensor_arguments_passed_are_written_by_name() -> None:
    x = torch.ones(3)
    assert arguments_text(torch.ops.aten.add.Tensor, (x, x), {"alpha": 2}) == "alpha=2"
    assert arguments_text(torch.ops.aten.div.Scalar, (x, 0.5), {}) == "other=0.5"
    assert arguments_text(torch.ops.aten.sum.dim_IntList, (x, [0]), {"keepdim": True}) == "dim=[0], keepdim=True"
    assert arguments_text(torch.ops.aten.to.dtype, (x, torch.float64), {}) == "dtype=torch.float64"


def test_a_strided_view_shows_its_offset_and_strides() -> None:
    view = torch.arange(12.0).reshape(3, 4).t()[1:]
    assert arguments_text(torch.ops.aten.clone.default, (view,), {}) == "self@1:[1, 4]"


def test_the_package_is_the_callers_past_torch_and_wrapper_classes() -> None:
    assert calling_package() == "tests"  # this module's package: the frame that called
    assert module_package(torch.nn.Linear(2, 2)) == "torch"

    class Model(torch.nn.Module):
        pass

    assert module_package(Model()) == "tests"
