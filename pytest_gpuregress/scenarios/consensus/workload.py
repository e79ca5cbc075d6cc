"""The single-device workload every device runs: no collective touches its numbers (world size 1 semantics).

Three parts, digested per tensor: ``train`` (a tiny MLP, a few AdamW steps), ``gemm`` (matmuls and reductions
in fp32, bf16, fp16) and ``cast`` (a fixed grid to every float format). Inputs are drawn on the host and moved,
so every device starts from the same bits; every op is deterministic (no atomics: the loss is a one-hot
product, not ``nll_loss``). Rank side: imports torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .digest import Digests

GEMM_SHAPES = ((64, 64, 64), (127, 253, 61), (256, 96, 512))  # (m, k, n): aligned, odd, tall
GEMM_DTYPES = ("float32", "bfloat16", "float16")


def _inputs(generator: torch.Generator, shape: tuple[int, ...], device: str, dtype: Any = torch.float32) -> Any:
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def train(device: str, config: dict[str, Any], digests: Digests) -> None:
    """A few deterministic AdamW steps of a seeded MLP on this device."""
    generator = torch.Generator().manual_seed(int(config["seed"]))
    width, hidden, classes, batch = (int(config[k]) for k in ("width", "hidden", "classes", "batch"))
    model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.LayerNorm(hidden),
                                torch.nn.Linear(hidden, classes))
    with torch.no_grad():  # seeded on the host, whatever the device's own generator would draw
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.to(device)
    steps = int(config["steps"])
    inputs = torch.randn((steps, batch, width), generator=generator)
    targets = F.one_hot(torch.randint(0, classes, (steps, batch), generator=generator), classes).to(torch.float32)
    # torch's own choice per device (foreach on GPUs), as users run it: peers vote among themselves, no reference
    # fixes the path.
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(config["lr"]))
    names = [name for name, _ in model.named_parameters()]
    for step in range(steps):
        logits = model(inputs[step].to(device))
        loss = -(F.log_softmax(logits, dim=-1) * targets[step].to(device)).sum(dim=-1).mean()
        loss.backward()
        digests.add("train", "loss", loss, step)
        for name, param in zip(names, model.parameters()):
            digests.add("train", f"grad {name}", param.grad, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for name, param in zip(names, model.parameters()):
            digests.add("train", f"weight {name}", param, step)


def gemm_battery(device: str, config: dict[str, Any], digests: Digests) -> None:
    """Matmuls of several shapes and dtypes, a batched matmul, and the common reductions."""
    generator = torch.Generator().manual_seed(int(config["seed"]) + 1)
    for dtype_name in GEMM_DTYPES:
        dtype = getattr(torch, dtype_name)
        for m, k, n in GEMM_SHAPES:
            a, b = _inputs(generator, (m, k), device, dtype), _inputs(generator, (k, n), device, dtype)
            digests.add("gemm", f"matmul {dtype_name} {m}x{k}x{n}", torch.matmul(a, b))
    a, b = _inputs(generator, (8, 33, 65), device), _inputs(generator, (8, 65, 17), device)
    digests.add("gemm", "bmm float32 8x33x65x17", torch.bmm(a, b))
    x = _inputs(generator, (257, 1031), device)
    reductions = {
        "sum dim 1": lambda t: t.sum(dim=1), "sum dim 0": lambda t: t.sum(dim=0), "sum all": lambda t: t.sum(),
        "mean dim 1": lambda t: t.mean(dim=1), "amax dim 0": lambda t: t.amax(dim=0),
        "norm dim 1": lambda t: torch.linalg.vector_norm(t, dim=1), "var dim 0": lambda t: t.var(dim=0),
        "softmax dim 1": lambda t: torch.softmax(t, dim=1), "logsumexp dim 1": lambda t: torch.logsumexp(t, dim=1),
    }
    for label, reduce in reductions.items():
        digests.add("gemm", f"{label} float32 257x1031", reduce(x))
    digests.add("gemm", "sum dim 1 bfloat16 257x1031", x.to(torch.bfloat16).sum(dim=1))


# Values a cast must get right: both zeros, infinities, NaN, the fp8 maxima and the ties just past them
# (e4m3fnuz 240, e4m3fn 448 and its overflow tie 464, e5m2 57344), subnormals, and ties at 1.
CAST_LITERALS = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, 1.0625, 1.125, 1.1875, 240.0, 248.0,
                 448.0, 464.0, 465.0, 500.0, 57344.0, 61440.0, 2.0**-6, 2.0**-9, 2.0**-10, 2.0**-14, 2.0**-16,
                 2.0**-17, 2.0**-24, 2.0**-25, 2.0**-126, 2.0**-127)
CAST_FORMATS = ("bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                "float8_e8m0fnu")


def cast_grid(generator: torch.Generator) -> Any:
    """The literals with both signs, then seeded values over 2**-30 .. 2**20, as float32 on the host."""
    literals = torch.tensor(CAST_LITERALS, dtype=torch.float32)
    spread = torch.randn(4096, generator=generator) * torch.exp2(torch.randint(-30, 20, (4096,), generator=generator))
    return torch.cat([literals, -literals, spread.to(torch.float32)])


def casts(device: str, config: dict[str, Any], digests: Digests) -> None:
    """The float32 grid cast to bf16, fp16 and each fp8 format this torch has, and every fp8 code decoded. torch's
    own casts, not the formats scenario's codec: its ml_dtypes oracle costs 1.5 s per process, for nothing here."""
    grid = cast_grid(torch.Generator().manual_seed(int(config["seed"]) + 2)).to(device)
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).to(device)
    for dtype_name in CAST_FORMATS:
        dtype = getattr(torch, dtype_name, None)
        if dtype is None:  # a format this torch lacks is left out on every device of its stack alike
            continue
        digests.add("cast", f"float32 grid to {dtype_name}", grid.to(dtype))
        if dtype.itemsize == 1:
            digests.add("cast", f"decode every {dtype_name} code", codes.view(dtype).to(torch.float32))


PARTS = {"train": train, "gemm": gemm_battery, "cast": casts}


def run_all(device: str, config: dict[str, Any]) -> Digests:
    """Every part of ``config["parts"]``, in that order, into one list of digests."""
    digests = Digests()
    for part in config["parts"]:
        PARTS[part](device, config, digests)
    return digests
