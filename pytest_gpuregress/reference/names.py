"""The one rule for names that become path components: reference names, platform keys, launch keys.

One folder or file name: ``[A-Za-z0-9._+-]+``, not ``.`` or ``..``, not starting with ``.`` (hidden names
are the store's interrupted writes, which the next write deletes).
"""

from __future__ import annotations

import re

from ..errors import UnsafeName

_SAFE = re.compile(r"[A-Za-z0-9._+-]+")
ALLOWED = "letters, digits, '.', '_', '+' and '-' (not starting with '.')"


def safe_component(value: object, what: str) -> str:
    """Return ``value`` if it is safe as one path component, else raise UnsafeName naming it and ``what`` it is."""
    if isinstance(value, str) and _SAFE.fullmatch(value) and not value.startswith("."):
        return value
    raise UnsafeName(
        f"{what} {value!r} cannot be a folder or file name: use only {ALLOWED}, e.g. 'my-model' or 'cpu-gloo-w2-fp32'"
    )
