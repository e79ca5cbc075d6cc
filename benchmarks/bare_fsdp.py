"""The yardstick: the fsdp scenario's model, data and 300 steps on 2 gloo ranks, with no plugin.

    python benchmarks/bare_fsdp.py [--steps 300] [--world-size 2]

No launcher, no recording, no fingerprint: a plain script that starts its ranks with subprocess,
as anyone would write it. It prints the wall time (start to last rank's exit) and each rank's
time inside the training loop, which benchmarks/bench.py sets against the plugin's.
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


def rank_main(rank: int, world: int, store_path: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pytest_gpuregress.scenarios.fsdp import COMMON, DEVICE_DEFAULTS
    from pytest_gpuregress.training.data import MarkovTokens
    from pytest_gpuregress.training.models import build_causal_lm, load_config
    from pytest_gpuregress.training.optimizer import lr_factor
    from pytest_gpuregress.training.step import next_token_loss, rank_tokens

    torch.set_num_threads(1)
    cfg = {**COMMON, **DEVICE_DEFAULTS["cpu"], "steps": steps}
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    model_config = load_config(cfg["model"], cfg["model_size"])
    model = build_causal_lm(model_config, seed=int(cfg["seed"]))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=float(cfg["lr"]), betas=tuple(cfg["betas"]), eps=float(cfg["eps"]),
                            weight_decay=float(cfg["weight_decay"]), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, steps, int(cfg["warmup_steps"]), float(cfg["min_lr_ratio"])))
    data = MarkovTokens(vocab_size=model_config.vocab_size, seq_len=int(cfg["seq_len"]),
                        global_batch=int(cfg["global_batch"]), seed=int(cfg["data_seed"]))

    class Ctx:  # what rank_tokens reads
        pass

    ctx = Ctx()
    ctx.rank, ctx.world_size = rank, world  # type: ignore[attr-defined]
    started = time.perf_counter()
    for step in range(steps):
        loss = next_token_loss(model, rank_tokens(data, step, ctx, "", "cpu"))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, float(cfg["grad_clip"]))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    train_s = time.perf_counter() - started
    Path(out).write_text(json.dumps({"rank": rank, "train_s": train_s, "final_loss": float(loss.detach())}))
    dist.barrier()
    dist.destroy_process_group()


def run_bare(steps: int = 300, world: int = 2) -> dict[str, float]:
    """Launch the bare loop; return wall time and the slowest rank's training-loop time."""
    with tempfile.TemporaryDirectory(prefix="gpuregress-bare-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        started = time.monotonic()
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world-size", str(world),
                                   "--steps", str(steps), "--store", f"{tmp}/store", "--out", f"{tmp}/rank{r}.json"],
                                  env=env) for r in range(world)]
        codes = [p.wait() for p in procs]
        wall = time.monotonic() - started
        if any(codes):
            raise SystemExit(f"bare loop failed: exit codes {codes}")
        results = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(world)]
    return {"wall_s": wall, "train_s": max(r["train_s"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--store")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world_size, args.store, args.steps, args.out)
        return
    result = run_bare(args.steps, args.world_size)
    print(f"bare loop, {args.steps} steps on {args.world_size} gloo ranks: wall {result['wall_s']:.1f}s, "
          f"training loop {result['train_s']:.1f}s")


if __name__ == "__main__":
    main()
