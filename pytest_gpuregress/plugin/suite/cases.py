"""The built-in suite: one pytest item per case of every registered scenario, under the node id ``gpuregress``.

Selected like any test (``gpuregress::fsdp``, ``-k``, ``-m``, ``--lf``). Warnings a case raises point at
this module's ``runtest`` (warn.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..collection import ROOT, BuiltinRequest, wanted
from ..selection import test_id

if TYPE_CHECKING:
    from ..session import GpuRegressSession


class BuiltinSuite(pytest.Collector):
    """The built-in cases; ``request``: which of them the command line named."""

    def __init__(self, *, session_of: Callable[[], GpuRegressSession], request: BuiltinRequest, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.session_of = session_of  # the session is built at configure time, after this plugin's hooks load
        self.request = request
        self.add_marker(pytest.mark.gpuregress)

    def collect(self) -> Iterator[BuiltinCase]:
        session = self.session_of()
        for scenario, case in session.selection.all_cases():
            case_id = test_id(scenario, case)
            if not wanted(self.request, case_id):
                continue
            # The file of the scenario's module, else this one's (an inline pytest run may have unloaded the module).
            source = getattr(sys.modules.get(type(scenario).__module__), "__file__", None) or __file__
            item = BuiltinCase.from_parent(self, name=case_id, scenario=scenario.name, case_id=case.id, source=source)
            item.add_marker(pytest.mark.gpuregress_training if scenario.kind == "training" else pytest.mark.gpuregress_check)
            for mark in case.marks:
                item.add_marker(getattr(pytest.mark, mark))
            shortfall = session.selection.rank_shortfall(case)
            if shortfall:  # collected and skipped with the reason: never a silent pass or a missing test
                item.add_marker(pytest.mark.skip(reason=shortfall))
            yield item

    def reportinfo(self) -> tuple[str, int | None, str]:
        return __file__, 0, ROOT


class BuiltinCase(pytest.Item):
    """One case of one scenario: a training run against its reference, or a check against its closed form."""

    def __init__(self, *, scenario: str, case_id: str, source: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case = (scenario, case_id)
        self.source = source  # the scenario's module: where a skip or a failure of this case is shown

    def runtest(self) -> None:
        __tracebackhide__ = True
        assert isinstance(self.parent, BuiltinSuite)
        self.parent.session_of().run_case(*self.case)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return self.source, 0, self.nodeid

    def _traceback_filter(self, excinfo: pytest.ExceptionInfo[BaseException]) -> Any:
        """An error of ours shows from this case's runtest on, as a test function's does from the function: the
        pytest and pluggy frames above it say nothing about the bug."""
        if self.config.getoption("fulltrace", False):
            return excinfo.traceback
        return excinfo.traceback.cut(path=Path(__file__)).filter(excinfo)
