"""One ``--gpuregress-<name>`` option, declared once: flag, ini key, type, validation, help and docs text.

Neutral (no torch, no pytest), so scenarios declare their options without importing the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# flag: on or off (the ini key takes true/false); list: repeatable (one per line in the ini file); csv:
# comma-separated; path: a file or folder, made absolute against the invocation's (or the ini file's) folder.
KINDS = ("flag", "str", "path", "int", "float", "bytes", "list", "csv", "choice")
# What a number of each kind looks like, for the message about one that is not.
_EXAMPLES = {"int": "an integer such as 300", "float": "a number such as 600",
             "bytes": "a size such as 4MiB, 512KiB or 65536"}


class BadOptionValue(ValueError):
    """A value that does not fit its option; the message names where it came from and what fits."""


@dataclass(frozen=True)
class OptionSpec:
    """One ``--gpuregress-<name>`` option (``name`` empty: ``--gpuregress`` itself).

    kind: one of ``KINDS``
    default: the value when neither the command line nor the ini file sets it
    help: one sentence, lower case, no final full stop: ``pytest --help`` shows it, the docs table starts with it
    choices: the values a ``choice`` takes
    minimum, maximum: the accepted range of an int, float or bytes option
    ini: the ini key when it is not the option's name with underscores (a repeatable option's plural)
    metavar: what the value is (DIR, FILE, SPEC), shown as ``--gpuregress-x=DIR``
    shown_default: the default in words (markdown), when the value itself does not say it
    details: the docs table's further sentences (markdown), after ``help``
    ini_relative: a path set in the ini file is relative to the ini file's folder, not the invocation's
    """

    name: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    ini: str | None = None
    metavar: str | None = None
    shown_default: str | None = None
    details: str = ""
    ini_relative: bool = False

    def __post_init__(self) -> None:
        # A plug-in's typo fails where it is written, not at the first run that reads the option.
        if self.kind not in KINDS:
            raise ValueError(f"option {self.flag}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"option {self.flag}: a choice option, and only one, lists its choices")
        if "](" in self.help + (self.shown_default or ""):
            raise ValueError(f"option {self.flag}: the terminal shows help and shown_default; put links in details")

    @property
    def flag(self) -> str:
        return f"--gpuregress-{self.name}" if self.name else "--gpuregress"

    @property
    def dest(self) -> str:
        """The argparse destination, e.g. ``gpuregress_collectives_repeats``; scenario values are keyed by it."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def ini_key(self) -> str:
        return self.ini or self.dest

    @property
    def takes_value(self) -> bool:
        return self.kind not in ("flag", "list")

    def default_text(self) -> str:
        """The default in words, as the docs table shows it (markdown)."""
        if self.shown_default is not None:
            return self.shown_default
        if self.kind == "flag":
            return "on" if self.default else "off"
        if self.default in (None, (), []):
            return "none"
        if self.kind == "choice":
            return f"`{self.default}`"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)

    def terminal_help(self) -> str:
        """``help`` for ``pytest --help``: without markdown, with the default of an option that takes a value."""
        text = plain(self.help)
        return f"{text} (default: {plain(self.default_text())})" if self.takes_value else text

    def convert(self, raw: Any, where: str) -> Any:
        """``raw`` (from the command line or the ini file; None: unset) as this option's type.

        ``where`` names the source in the message of ``BadOptionValue``: the flag, or ``ini key x =``.
        """
        if raw is None:
            return self.default
        if self.kind == "flag":
            return bool(raw)
        if self.kind == "list":
            return list(raw)
        if self.kind == "csv":
            return [part.strip() for part in str(raw).split(",") if part.strip()]
        if self.kind == "choice":
            if raw not in self.choices:
                raise BadOptionValue(f"{where} {raw!r}: must be one of {', '.join(self.choices)}")
            return raw
        if self.kind == "str":
            return str(raw)
        if self.kind == "path":
            return Path(str(raw))
        return self._number(str(raw).strip(), raw, where)

    def _number(self, text: str, raw: Any, where: str) -> float:
        try:
            if self.kind == "bytes":
                from .units import parse_bytes  # imported here: only a run that sets a size pays for it

                value: float = parse_bytes(text)
            else:
                value = int(text) if self.kind == "int" else float(text)
        except ValueError:
            raise BadOptionValue(f"{where} {raw!r}: expected {_EXAMPLES[self.kind]}") from None
        if self.minimum is not None and value < self.minimum:
            raise BadOptionValue(f"{where} {raw!r}: must be at least {self.minimum:g}")
        if self.maximum is not None and value > self.maximum:
            raise BadOptionValue(f"{where} {raw!r}: must be at most {self.maximum:g}")
        return value


def plain(markdown: str) -> str:
    """A help text's markdown as a terminal shows it: without backticks (it has no links: see __post_init__)."""
    return markdown.replace("`", "")
