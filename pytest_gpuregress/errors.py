"""Exceptions raised by pytest-gpuregress.

Every error a user can hit names the file or rank involved and says how to fix it.
"""

from __future__ import annotations

import re


class GpuRegressError(Exception):
    """Base class for every error this plugin raises on purpose."""


class FileProblem(GpuRegressError):
    """A file that cannot be used: its path (``where``: with a line or a tensor), the problem, and the fix."""

    def __init__(self, path: object, problem: str, fix: str, where: str | None = None) -> None:
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        super().__init__(f"{where or self.path}: {problem}\n  fix: {fix}")


class ReferenceProblem(FileProblem):
    """A stored reference cannot be used: missing, corrupt or foreign."""


class MissingReference(ReferenceProblem):
    """No reference was recorded for this scenario and platform."""


class CorruptReference(ReferenceProblem):
    """The files exist but do not parse or do not match their manifest."""


class ForeignReference(ReferenceProblem):
    """The reference is valid but was recorded for another scenario configuration."""


class ReferenceExists(ReferenceProblem):
    """Refusing to overwrite a reference without the record flag."""


class RankFailure(GpuRegressError):
    """One or more ranks raised, crashed or hung; the message carries per-rank detail."""


class UnsupportedPlatform(GpuRegressError):
    """The requested device, backend or world size is not available here."""


class BadFaultSpec(GpuRegressError):
    """A fault-injection spec could not be parsed."""


class ScenarioProblem(GpuRegressError):
    """A scenario cannot be found, imported or used."""


class RegressionFailure(AssertionError):
    """A run differs from its reference, or a check case from its closed-form result. The message is the report."""


class CallRejected(GpuRegressError):
    """torch's own argument checks turned down a call the plugin made: a bug of the plugin, not of the stack."""


class NotApplicable(GpuRegressError):
    """What was asked cannot apply on this platform or launch mode; a test that needs it is skipped."""


# What torch.distributed says where a backend lacks an op (gloo before torch 2.12: "Backend gloo does not support
# alltoall"), in its own words and naming a collective: an op that ran and failed ("operation not supported" from a
# driver, a kernel "not implemented" for a dtype) never reads as a missing op.
_BACKEND_LACKS = re.compile(r"\bBackend \w+ does not support (all_?\w+|reduce_?scatter\w*|broadcast\w*|gather\w*|"
                            r"scatter\w*|reduce\w*|send\w*|recv\w*|barrier)\b")


_KERNEL_PATH_LACKS = re.compile(r"\b\w+ is only supported when (avx\w*|amx\w*|sve\w*|neon\w*) is supported\b", re.I)


class NotSupported(NotApplicable):
    """This stack lacks an op a case needs: skipped, with the backend, the torch version and the op; never a
    failure, since no number was wrong, and said in the closing summary as a capability this stack lacks."""

    @staticmethod
    def backend_lacks(error: BaseException | str) -> str | None:
        """Where ``error`` (one op's exception, or a rank's whole failure) has torch.distributed saying its backend
        lacks a collective, that sentence; None otherwise."""
        found = _BACKEND_LACKS.search(str(error))
        return found.group(0) if found else None

    @staticmethod
    def kernel_path_lacks(error: BaseException | str) -> str | None:
        """Where ``error`` has a CPU kernel path refusing an op its instruction set lacks (torch 2.13's bf16 attention
        on the AVX2 path of an AMX CPU: "pack_vnni2 is only supported when avx512 is supported"), that sentence."""
        found = _KERNEL_PATH_LACKS.search(str(error))
        return found.group(0) if found else None


class UnsafeName(GpuRegressError):
    """A name that would become a folder or file name could leave its directory or hide in it."""


class BadKnownIssues(FileProblem):
    """A known-issues file (the shipped one or gpuregress_known_issues) is missing, not TOML, or breaks the schema."""

    def __init__(self, path: object, line: int | None, problem: str, fix: str) -> None:
        self.line = line
        super().__init__(path, problem, fix, f"{path}:{line}" if line else None)


class BadTokens(GpuRegressError):
    """A token file (--gpuregress-tokens) that is missing, unreadable, not integer ids, or outside the vocabulary."""

    def __init__(self, path: object, problem: str, fix: str, option: str = "--gpuregress-tokens") -> None:
        self.path = str(path)
        super().__init__(f"{option} {self.path}: {problem}; {fix}")


class BadModel(GpuRegressError):
    """A model given with --gpuregress-model that cannot be found, built, named or trained on this device."""

    def __init__(self, source: object, problem: str, fix: str) -> None:
        self.source = str(source)
        super().__init__(f"--gpuregress-model {self.source}: {problem}; {fix}")


class CheckpointProblem(FileProblem):
    """A checkpoint (quantized or not) cannot be read or understood; names the file and, where known, the tensor."""

    def __init__(self, path: object, tensor: str | None, problem: str, fix: str) -> None:
        self.tensor = tensor
        super().__init__(path, problem, fix, f"{path}, tensor {tensor!r}" if tensor else None)
