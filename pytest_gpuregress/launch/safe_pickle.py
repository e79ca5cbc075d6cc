"""Read a pickle that may only hold plain data: dicts, lists, tuples, strings, bytes, numbers, booleans, None.

For torch's flight-recorder dump, which may come from a bug report. Opcodes that name, build or call an
object are refused before loading, and the ``Unpickler``'s ``find_class`` raises, so nothing runs.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

# Opcodes that build plain data only (every protocol's spelling of containers, strings, numbers and the memo).
_PLAIN = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "NONE", "NEWTRUE", "NEWFALSE",
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_SET", "ADDITEMS", "FROZENSET",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
})


class UnreadablePickle(ValueError):
    """Not plain data in a well-formed pickle."""


class UnsafePickle(UnreadablePickle):
    """The pickle names Python code (a global, a class, a call): refused before anything ran."""


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickle(f"names the Python global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("holds a persistent reference")


def loads(data: bytes, what: str = "the pickle") -> Any:
    """The plain data in ``data``; ``UnsafePickle`` naming the first opcode (and global) that is not plain data,
    ``UnreadablePickle`` for a truncated or malformed one."""
    try:
        first = next(((op, arg, pos) for op, arg, pos in pickletools.genops(data) if op.name not in _PLAIN), None)
    except Exception as exc:  # noqa: BLE001 - pickletools raises ValueError, UnicodeDecodeError, ...: all "not a pickle"
        raise UnreadablePickle(f"cannot read {what}: not a well-formed pickle ({exc})") from None
    if first is not None:
        op, arg, pos = first
        named = f" ({arg.replace(' ', '.')})" if op.name in ("GLOBAL", "INST") and isinstance(arg, str) else ""
        raise UnsafePickle(f"refused to read {what}: it holds opcode {op.name}{named} at byte {pos}, which names or "
                           "calls Python code; a flight-recorder dump holds only dicts, lists, strings and numbers, so "
                           "this file is not one or was altered. Nothing in it ran")
    try:
        return _NoGlobals(io.BytesIO(data)).load()
    except UnsafePickle as exc:
        raise UnsafePickle(f"refused to read {what}: it {exc}; nothing in it ran") from None
    except Exception as exc:  # noqa: BLE001 - a truncated dump (the rank was killed while writing) and the like
        raise UnreadablePickle(f"cannot read {what}: not a well-formed pickle ({exc})") from None
