"""Session side: the pieces of a training state's digests (training/state_digests.py), compared piece by piece.

A resume names what broke by piece (``optimizer.exp_avg``, ``rng.<generator>``, ...); the checkpoint
scenario's resume case and the reference resumes share this, so a broken piece reads the same. torch-free.
"""

from __future__ import annotations

import hashlib

Digests = dict[str, dict[str, str]]  # piece -> item (a parameter, a group, a rank) -> digest

ORDER = ("model", "model.frozen", "optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.step", "optimizer.param_groups",
         "lr_scheduler", "rng.python", "rng.numpy", "rng.torch_cpu", "rng.torch_device", "data.position")


def order(piece: str) -> tuple[int, str]:
    """Sort key: the pieces in ORDER's order, any other after them by name."""
    return (ORDER.index(piece) if piece in ORDER else len(ORDER), piece)


def merge_boundaries(boundaries: list[Digests]) -> Digests:
    """Every rank's digests in one table (index = rank): tensors from rank 0, generators from each rank."""
    merged: Digests = {}
    for rank, boundary in enumerate(boundaries):
        for piece, items in boundary.items():
            if rank == 0 or piece.startswith("rng."):
                merged.setdefault(piece, {}).update(items)
    return merged


def piece_digest(items: dict[str, str]) -> str:
    """One digest of a whole piece, for a table column."""
    return hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(items.items())).encode()).hexdigest()


def differs(piece: str, expected: dict[str, str], got: dict[str, str]) -> str:
    """'' when equal; else how many items differ and the first."""
    names = sorted(set(expected) | set(got))
    wrong = [n for n in names if expected.get(n) != got.get(n)]
    if not wrong:
        return ""
    first = wrong[0]
    unit = "ranks" if piece.startswith("rng.") else "tensors" if piece.startswith(("model", "optimizer.e", "optimizer.s")) \
        else "entries"
    detail = f"{first}: {expected.get(first, '-')} -> {got.get(first, '-')}" if len(expected.get(first, "")) < 20 else first
    return f"{len(wrong)} of {len(names)} {unit} differ, first {detail}"


def differing(expected: Digests, got: Digests) -> list[tuple[str, str]]:
    """(piece, how it differs) for every piece whose items are not the expected ones, in ORDER's order; a piece only
    ``got`` has is not judged (the reference was saved before that piece was digested)."""
    pieces = sorted(expected, key=order)
    return [(piece, why) for piece in pieces if (why := differs(piece, expected.get(piece, {}), got.get(piece, {})))]
