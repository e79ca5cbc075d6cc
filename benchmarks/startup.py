"""What the plugin costs a pytest run without --gpuregress: start-up time and imports.

Runs ``pytest --co -q -p no:cacheprovider`` in an empty folder N times with the plugin and with
``-p no:gpuregress`` (alternating, so load on the machine hits both alike) and prints the median
wall times and their difference; then the modules importing the plugin adds after pytest itself,
by cumulative time (``python -X importtime``). The goal is a difference under 30 ms.

    python benchmarks/startup.py --runs 10
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

PYTEST = [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider"]
MARK = "--gpuregress-startup-mark--"


def _env(pycache: str) -> dict[str, str]:
    # The user's PYTEST_ADDOPTS could turn --gpuregress on, or plugins off: measure the bare run.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONDONTWRITEBYTECODE")}
    # An installed plugin has its bytecode cached: without a cache every run would time the compiler.
    # Out of the source tree, so the checkout stays as it was.
    env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _seconds(args: list[str], folder: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run; CPU time suffers less than wall time from a loaded machine."""
    start, cpu = time.perf_counter(), _cpu_of_children()
    subprocess.run(args, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start, _cpu_of_children() - cpu


def time_startup(runs: int, env: dict[str, str]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(wall, CPU) seconds of each run with the plugin and without it."""
    with_plugin: list[tuple[float, float]] = []
    without: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as folder:
        _seconds(PYTEST, folder, env)  # fill the file cache and the bytecode cache before timing
        for _ in range(runs):
            with_plugin.append(_seconds(PYTEST, folder, env))
            without.append(_seconds([*PYTEST, "-p", "no:gpuregress"], folder, env))
    return with_plugin, without


def plugin_imports(top: int, env: dict[str, str]) -> list[tuple[int, str]]:
    """(cumulative microseconds, module) of the imports the plugin adds once pytest is loaded."""
    code = f"import pytest, sys; sys.stderr.write('{MARK}\\n'); import pytest_gpuregress.plugin"
    command = [sys.executable, "-X", "importtime", "-c", code]
    where = tempfile.gettempdir()  # not a checkout, whose own copy of the package would come first on sys.path
    subprocess.run(command, cwd=where, env=env, capture_output=True, check=True)  # caches the plain bytecode
    err = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, check=True).stderr
    rows = []
    for line in err.split(MARK, 1)[1].splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        if cumulative.strip().isdigit():
            rows.append((int(cumulative), name.rstrip()))
    return sorted(rows, reverse=True)[:top]


def _medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def _row(label: str, times: list[tuple[float, float]]) -> None:
    walls, cpus = [t[0] * 1e3 for t in times], [t[1] * 1e3 for t in times]
    print(f"  {label:<22} {statistics.median(walls):9.1f} ({min(walls):6.1f})   {statistics.median(cpus):9.1f} ({min(cpus):6.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="timed runs of each kind (default 10)")
    parser.add_argument("--top", type=int, default=15, help="imports to list (default 15)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as pycache:
        env = _env(pycache)
        with_plugin, without = time_startup(args.runs, env)
        imports = plugin_imports(args.top, env)
    print(f"pytest --co -q in an empty folder, {args.runs} runs each:   wall median (min)   CPU median (min), ms")
    _row("with the plugin", with_plugin)
    _row("-p no:gpuregress", without)
    (on_wall, on_cpu), (off_wall, off_cpu) = _medians(with_plugin), _medians(without)
    print(f"  {'plugin cost (medians)':<22} {(on_wall - off_wall) * 1e3:9.1f}          {(on_cpu - off_cpu) * 1e3:9.1f}"
          "          (goal: under 30 ms)")
    print("\nimports the plugin adds after pytest's, by cumulative time (us; indented = nested):")
    for micros, name in imports:
        print(f"  {micros:8d}  {name}")


if __name__ == "__main__":
    main()
