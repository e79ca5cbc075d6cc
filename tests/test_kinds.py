"""The closed sets of names several layers share (pytest_gpuregress/kinds.py): the options that choose among them
offer exactly their values, take each and refuse any other naming the set, and docs/options.md names every value;
this machine's platform is named from the sets."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest

from pytest_gpuregress import kinds
from pytest_gpuregress.option_spec import BadOptionValue
from pytest_gpuregress.plugin.options import FIELDS
from pytest_gpuregress.stack.platforms import resolve_platform

OPTIONS_DOC = Path(__file__).resolve().parents[1] / "docs" / "options.md"
# Options field -> (the closed set it chooses from, the values it offers beside it)
CHOOSERS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "device": (kinds.DeviceKind, ("auto",)),
    "lane": (kinds.LaneChoice, ()),
    "perf": (kinds.GateMode, ()),
    "kernel_changes": (kinds.KernelChanges, ()),
}


@pytest.mark.parametrize("field", sorted(CHOOSERS))
def test_an_option_offers_exactly_its_sets_values_and_refuses_any_other(field: str) -> None:
    """Each value of the set is taken as is; a value outside it is refused, the message listing the set."""
    closed, extra = CHOOSERS[field]
    spec = FIELDS[field].spec
    assert spec.choices == (*extra, *get_args(closed))
    assert spec.default in spec.choices
    assert [spec.convert(value, spec.flag) for value in get_args(closed)] == list(get_args(closed))
    with pytest.raises(BadOptionValue) as refused:
        spec.convert("fuzzy", spec.flag)
    assert str(refused.value).endswith(f"must be one of {', '.join(spec.choices)}")


@pytest.mark.parametrize("field", sorted(CHOOSERS))
def test_the_options_docs_name_every_value_of_the_set(field: str) -> None:
    """docs/options.md's row of the option names each value in backticks, as the command line takes it."""
    spec = FIELDS[field].spec
    (row,) = [line for line in OPTIONS_DOC.read_text().splitlines() if line.startswith(f"| `{spec.flag}` |")]
    assert [value for value in spec.choices if f"`{value}`" not in row] == []


def test_this_machines_platform_is_named_from_the_sets() -> None:
    """A CPU run's device, backend and vendor are values of their sets; a ROCm GPU reports device ``cuda`` with
    vendor ``rocm`` (kinds.py: ROCm builds of torch report cuda too)."""
    platform = resolve_platform("cpu", 2)
    assert (platform.device_kind, platform.backend, platform.vendor) == ("cpu", "gloo", "cpu")
    assert platform.device_kind in get_args(kinds.DeviceKind) and platform.backend in get_args(kinds.Backend)
    assert platform.vendor in get_args(kinds.Vendor)
    assert "rocm" in get_args(kinds.Vendor) and "rocm" not in get_args(kinds.DeviceKind)
