"""docs/options.md's tables, generated from the option declarations (plugin/options.py, option_spec.py).

Regenerate after changing a declaration (tests/test_docs_commands.py keeps it equal):

    python -m pytest_gpuregress.plugin.options_doc docs/options.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..option_spec import SCENARIO_OPTIONS, OptionSpec
from .options import CORE_OPTIONS

BEGIN = ("<!-- generated from the option declarations (pytest_gpuregress/plugin/options.py and "
         "pytest_gpuregress/option_spec.py): edit those, then run "
         "python -m pytest_gpuregress.plugin.options_doc docs/options.md -->")
END = "<!-- end of the generated options -->"


def options_markdown() -> str:
    """The generated block, markers included."""
    lines = [BEGIN, "| option | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| {_flag(spec)} | {_cell(spec.default_text())} | {_cell(meaning(spec))} |" for spec in CORE_OPTIONS]
    lines += ["", "The built-in scenarios' own options:", "",
              "| option | scenario | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| {_flag(spec)} | `{scenario}` | {_cell(spec.default_text())} | {_cell(meaning(spec))} |"
              for scenario, specs in SCENARIO_OPTIONS.items() for spec in specs]
    ini_relative = [f"`{spec.ini_key}`" for spec in CORE_OPTIONS if spec.ini_relative]
    lines += ["", f"Paths in the ini file for {_and(ini_relative)} are relative to the ini file's folder; the other "
              "paths, and every path on the command line, are relative to the folder pytest runs in.", END]
    return "\n".join(lines) + "\n"


def meaning(spec: OptionSpec) -> str:
    """The docs' sentences for an option: its help, its details, and a repeatable option's ini spelling."""
    text = spec.help[:1].upper() + spec.help[1:] + "."
    if spec.details:
        text += " " + spec.details
    if spec.kind == "list":
        text += f" In the ini file: `{spec.ini_key}`, one per line."
    return text


def replace_block(document: str) -> str:
    """``document`` with its generated block (from BEGIN to END) replaced by the current one."""
    start, end = document.find(BEGIN), document.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the generated block's markers are missing; put these two lines where it goes:\n{BEGIN}\n{END}")
    return document[:start] + options_markdown() + document[end + len(END):].removeprefix("\n")


def _flag(spec: OptionSpec) -> str:
    return f"`{spec.flag}={spec.metavar}`" if spec.metavar else f"`{spec.flag}`"


def _cell(markdown: str) -> str:
    return markdown.replace("|", "\\|")  # a pipe would end the table cell


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = Path(argv[0])
    path.write_text(replace_block(path.read_text()))
    print(f"rewrote the options tables of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
