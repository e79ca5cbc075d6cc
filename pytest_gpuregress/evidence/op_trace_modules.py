"""Where an op of the step-0 trace ran: its module path in forward and in backward, and FSDP2's unit.

Forward: a stack kept by global module hooks. Backward: the autograd node being run, labelled at forward
time by each module's post-hook (exact per node, which backward hooks are not under FSDP2). FSDP2's
record_function regions name the unit a collective works for. Hooks only read.
Torch is imported inside the functions: only the ranks call them.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

from .op_arguments import module_package
from .op_trace import ROOT

LABEL = "gpuregress_module"  # the key of autograd node metadata that holds the module path
_FSDP_REGION = re.compile(r"^FSDP::\S+(?: \((?P<fqn>[^)]*)\)| for (?P<target>\S+))?$")


def tensors_in(value: Any) -> Iterator[Any]:
    """Every tensor in ``value``: nested tuples, lists, dicts and ModelOutputs (a dict)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def fsdp_unit(regions: list[str]) -> str | None:
    """The FSDP2 unit the innermost FSDP region works for (ROOT for the root), or None outside FSDP regions."""
    for name in reversed(regions):
        found = _FSDP_REGION.match(name)
        if found:
            return found.group("fqn") or found.group("target") or ROOT
    return None


def _inside(label: str, path: str) -> bool:
    return path == ROOT or label == path or label.startswith(path + ".")


def _grad_fns(tensors: Iterable[Any]) -> list[Any]:
    """The autograd nodes that made ``tensors``, leaving out those autograd did not make."""
    return [node for node in (t.grad_fn for t in tensors) if node is not None]


def label_graph(outputs: Iterable[Any], inputs: Iterable[Any], path: str) -> None:
    """Label the autograd nodes between a module's ``outputs`` and its ``inputs`` with ``path``, where unlabelled. The
    walk stops at the inputs' nodes and at nodes labelled by a module outside this one: never earlier layers'."""
    # Nodes by identity, each kept alive for the walk: some torch releases (2.11) hand out a new Python wrapper of a
    # node at every access, and a wrapper freed early lends its id to the next one, which would read as seen.
    stop = {id(node): node for node in _grad_fns(inputs)}
    todo = _grad_fns(outputs)
    seen: dict[int, Any] = {}
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        label = node.metadata.get(LABEL)
        if label is None:
            node.metadata[LABEL] = path
        elif not _inside(label, path):
            continue
        todo.extend(following for following, _ in node.next_functions)


class ModulePaths:
    """The module path of the op running now, in forward and backward (see the module docstring)."""

    def __init__(self, model: Any | None) -> None:
        self._names: dict[int, str] = {id(m): n or ROOT for n, m in model.named_modules()} if model is not None else {}
        # Each label's package (op_arguments.module_package): whose code an op under it ran.
        self._packages: dict[str, str] = {n or ROOT: module_package(m) for n, m in model.named_modules()} \
            if model is not None else {}
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def name_of(self, module: Any) -> str:
        """The module's path in the model; a module the model does not register (a hub kernel's ``Func`` that
        ``kernels`` wraps a function in, a functional wrapper, a hook's module) is labelled from where it ran:
        ``model.layers.0.self_attn.<Func>``, never a bare class name that says nothing of where."""
        found = self._names.get(id(module))
        if found is not None:
            return found
        inside = self._stack[-1] if self._stack else ""
        label = f"{inside}.<{type(module).__name__}>" if inside else f"<{type(module).__name__}>"
        self._packages.setdefault(label, module_package(module))
        return label

    def package_of(self, label: str) -> str | None:
        """The package whose module ``label`` names (None for no module, or a label not met)."""
        return self._packages.get(label) if label else None

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        if self._handles:
            return
        self._handles = [register_module_forward_pre_hook(self._enter),
                         register_module_forward_hook(self._leave, with_kwargs=True, always_call=True)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []

    def _enter(self, module: Any, args: Any) -> None:
        self._stack.append(self.name_of(module))

    def _leave(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        path = self._stack.pop() if self._stack else self.name_of(module)
        import torch

        if torch.is_grad_enabled():
            label_graph(tensors_in(output), [*tensors_in(args), *tensors_in(kwargs)], path)

    def forward(self) -> str:
        """The innermost module running, or "" outside every module (the loss, the loop)."""
        return self._stack[-1] if self._stack else ""

    @staticmethod
    def backward() -> str:
        import torch

        node = torch._C._current_autograd_node()
        return str(node.metadata.get(LABEL, "")) if node is not None else ""


class ParameterLineage:
    """Which parameter an op of clipping or the optimizer works on: storages of each parameter, its gradient
    and what ops made from them (optimizer state), mapped to the parameter's name."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        self._finalizers: list[weakref.finalize] = []

    def _key(self, tensor: Any) -> int:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self._names:  # forgotten when freed: ids are reused
            self._finalizers.append(weakref.finalize(storage, self._names.pop, key, None))
        return key

    def close(self) -> None:
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers, self._names = [], {}

    def seed(self, named_parameters: Iterable[tuple[str, Any]]) -> None:
        for name, param in named_parameters:
            for tensor in (param, param.grad):
                local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
                if local is not None:
                    self._names.setdefault(self._key(local), name)

    def name(self, inputs: Iterable[Any]) -> str:
        for tensor in inputs:
            found = self._names.get(id(tensor.untyped_storage()))
            if found is not None:
                return found
        return ""

    def inherit(self, name: str, outputs: Iterable[Any]) -> None:
        if name:
            for tensor in outputs:
                self._names.setdefault(self._key(tensor), name)
