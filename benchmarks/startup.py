"""What the plugin costs a pytest run without --gpuregress: start-up time and imports.

Runs ``pytest --co -q -p no:cacheprovider`` in an empty folder N times with the plugin and with
``-p no:gpuregress`` (alternating, so load on the machine hits both alike) and prints the median
wall and CPU times and their differences; then the modules importing the plugin adds after pytest
itself, by cumulative time (``python -X importtime``). The goal is a difference under 30 ms.

On a loaded machine (the load average is printed first) wall times mean little: read the CPU times,
with many runs, and the difference of the minimums, which load inflates least.
``--instructions`` counts the instructions of one run of each under valgrind's callgrind instead: the
same on a busy machine as on an idle one (about a minute each). ``--no-bytecode-cache`` measures a
user with PYTHONDONTWRITEBYTECODE set: Python compiles, and pytest rewrites the asserts of, every
plugin module it imports, on every run.

    python benchmarks/startup.py --runs 10
    python benchmarks/startup.py --runs 10 --instructions
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PYTEST = [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider"]
MARK = "--gpuregress-startup-mark--"


def _env(pycache: str, bytecode_cache: bool = True) -> dict[str, str]:
    # The user's PYTEST_ADDOPTS could turn --gpuregress on, or plugins off: measure the bare run.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONDONTWRITEBYTECODE")}
    # An installed plugin has its bytecode cached: without a cache every run would time the compiler.
    # Out of the source tree, so the checkout stays as it was.
    env["PYTHONPYCACHEPREFIX"] = pycache
    if not bytecode_cache:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
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


def count_instructions(env: dict[str, str]) -> tuple[int, int]:
    """Instructions of one run with the plugin and one without, under callgrind (deterministic, unlike time)."""
    counts = []
    with tempfile.TemporaryDirectory() as folder:
        for args in (PYTEST, [*PYTEST, "-p", "no:gpuregress"]):
            subprocess.run(args, cwd=folder, env=env, capture_output=True, check=False)  # the bytecode cache
            done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/callgrind.out",
                                   *args], cwd=folder, env={**env, "PYTHONHASHSEED": "0"}, capture_output=True,
                                  text=True, check=False)
            found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
            if found is None:
                raise SystemExit(f"callgrind gave no instruction count:\n{done.stderr[-2000:]}")
            counts.append(int(found.group(1).replace(",", "")))
    return counts[0], counts[1]


def _minimums(times: list[tuple[float, float]]) -> tuple[float, float]:
    return min(t[0] for t in times), min(t[1] for t in times)


def _row(label: str, times: list[tuple[float, float]]) -> None:
    walls, cpus = [t[0] * 1e3 for t in times], [t[1] * 1e3 for t in times]
    print(f"  {label:<22} {statistics.median(walls):9.1f} ({min(walls):6.1f})   {statistics.median(cpus):9.1f} ({min(cpus):6.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="timed runs of each kind (default 10)")
    parser.add_argument("--top", type=int, default=15, help="imports to list (default 15)")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="run pytest with PYTHONDONTWRITEBYTECODE=1, as some CI images do")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions under valgrind (callgrind): unaffected by load")
    args = parser.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind (apt-get install valgrind)")

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as pycache:
        env = _env(pycache, bytecode_cache=not args.no_bytecode_cache)
        with_plugin, without = time_startup(args.runs, env)
        imports = plugin_imports(args.top, env)
        instructions = count_instructions(env) if args.instructions else None
    print(f"pytest --co -q in an empty folder, {args.runs} runs each:   wall median (min)   CPU median (min), ms")
    _row("with the plugin", with_plugin)
    _row("-p no:gpuregress", without)
    (on_wall, on_cpu), (off_wall, off_cpu) = _medians(with_plugin), _medians(without)
    print(f"  {'plugin cost (medians)':<22} {(on_wall - off_wall) * 1e3:9.1f}          {(on_cpu - off_cpu) * 1e3:9.1f}"
          "          (goal: under 30 ms)")
    (on_wall, on_cpu), (off_wall, off_cpu) = _minimums(with_plugin), _minimums(without)
    print(f"  {'plugin cost (minimums)':<22} {(on_wall - off_wall) * 1e3:9.1f}          {(on_cpu - off_cpu) * 1e3:9.1f}")
    if instructions is not None:
        on, off = instructions
        per_ms = off / (_minimums(without)[1] * 1e3)  # this machine's rate, from the fastest run without the plugin
        print(f"\ninstructions (callgrind, one run each): with the plugin {on:,}, without {off:,}; "
              f"the plugin's {on - off:,} ({(on - off) / off:.1%}), about {(on - off) / per_ms:.1f} ms of CPU here")
    print("\nimports the plugin adds after pytest's, by cumulative time (us; indented = nested):")
    for micros, name in imports:
        print(f"  {micros:8d}  {name}")


if __name__ == "__main__":
    main()
