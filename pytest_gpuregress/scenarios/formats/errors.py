"""The error a bad checkpoint raises. It belongs in pytest_gpuregress/errors.py; it lives here
until that file can take it (another change owns it now)."""

from __future__ import annotations

from ...errors import GpuRegressError


class CheckpointProblem(GpuRegressError):
    """A quantized checkpoint cannot be read or understood; names the file and, where known, the tensor."""

    def __init__(self, path: object, tensor: str | None, problem: str, fix: str) -> None:
        self.path = str(path)
        self.tensor = tensor
        self.problem = problem
        self.fix = fix
        where = f"{self.path}, tensor {tensor!r}" if tensor else self.path
        super().__init__(f"{where}: {problem}\n  fix: {fix}")
