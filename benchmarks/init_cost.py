"""What building a model and seeding its initial weights costs a launch, on the CPU model and the GPU-size one.

Each launch is a fresh process (its imports not timed) that builds the model as a rank does
(training/models.py ``build_causal_lm``) and prints two figures: the build (constructing the model; before
meta_build.py that ran the library's own init) and the init (seed_parameters: computing, or reading from the
cache, every initial value). Per size, three launches:

  - old: the build with the library's init and the old seeding, one pass over each array, no cache (what every
    launch cost before; the implementation tests/training/test_init_cost.py keeps as its reference);
  - first launch: an empty cache folder (GPUREGRESS_INIT_CACHE), so large parameters are computed and stored;
  - later launch: the same folder, warm.

Each launch also hashes every parameter and buffer (not timed): the three digests must agree, the new build
giving the old one's bits.

    python benchmarks/init_cost.py                   # tiny-llama, cpu and gpu size: about a minute on 2 cores
    python benchmarks/init_cost.py --sizes gpu --model tiny-moe
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def launch(model: str, size: str, old: bool) -> dict[str, Any]:
    """One launch in this process: seconds to build and to seed, and a digest of every tensor."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM

    from pytest_gpuregress.training import seeding
    from pytest_gpuregress.training.dropout import silence_modules, switch_off
    from pytest_gpuregress.training.meta_build import without_init
    from pytest_gpuregress.training.models import isolated_generators, load_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.test_init_cost import old_seed_parameters  # the implementation before, kept as the tests' reference

    config = load_config(model, size)
    switch_off(config)
    with torch.device("meta"):  # imports the model's module: an import, not the build, and paid before either
        AutoModelForCausalLM.from_config(config)
    start = time.perf_counter()
    with isolated_generators(), torch.device("cpu"):
        if old:
            built, fast = AutoModelForCausalLM.from_config(config), False
        else:  # as build_causal_lm does
            built, fast = without_init(lambda: AutoModelForCausalLM.from_config(config))
    silence_modules(built)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    if old:
        old_seed_parameters(built, 0, float(config.initializer_range))
    else:
        seeding.seed_parameters(built, 0, float(config.initializer_range))
    init_s = time.perf_counter() - start
    digest = hashlib.sha256()
    tensors = {**dict(built.named_parameters(remove_duplicate=False)), **dict(built.named_buffers(remove_duplicate=False))}
    for name, tensor in sorted(tensors.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"build_s": build_s, "init_s": init_s, "meta_build": fast, "digest": digest.hexdigest()[:16],
            "parameters": sum(p.numel() for p in built.parameters())}


def run_launch(model: str, size: str, old: bool, cache: Path) -> dict[str, Any]:
    env = {**os.environ, "GPUREGRESS_INIT_CACHE": str(cache)}
    done = subprocess.run([sys.executable, __file__, "--launch", model, size, "old" if old else "new"],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--sizes", nargs="+", default=["cpu", "gpu"], choices=["cpu", "gpu"])
    parser.add_argument("--launch", nargs=3, help=argparse.SUPPRESS)  # internal: one launch, JSON on stdout
    args = parser.parse_args()
    if args.launch:
        model, size, mode = args.launch
        print(json.dumps(launch(model, size, mode == "old")))
        return
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'model':<22} {'launch':<14} {'build s':>8} {'init s':>8} {'total s':>8}  digest")
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp) / "init-cache"
            digests = set()
            for label, old in (("old", True), ("first launch", False), ("later launch", False)):
                got = run_launch(args.model, size, old, cache)
                digests.add(got["digest"])
                name = f"{args.model} {size} ({got['parameters'] / 1e6:.1f} M)"
                print(f"{name:<22} {label:<14} {got['build_s']:8.2f} {got['init_s']:8.2f} "
                      f"{got['build_s'] + got['init_s']:8.2f}  {got['digest']}"
                      + ("" if old or got["meta_build"] else "  (built the plain way)"))
            print(f"{'':<22} cache: {folder_bytes(cache) / 2**20:.0f} MiB; "
                  + ("the three builds are bit for bit the same" if len(digests) == 1 else "THE BUILDS DIFFER"))


if __name__ == "__main__":
    main()
