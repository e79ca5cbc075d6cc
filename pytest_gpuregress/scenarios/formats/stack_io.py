"""The quantized checkpoints through the stack's own I/O, the paths users load fp8 and fp4 weights with. Rank side.

Each file the codec wrote goes through safetensors, safe_open, torch_load, dcp and transformers, checked byte for
byte both ways (docs/formats.md). The stack's functions are looked up through their modules at call time, so a fault
placed in a loader (faults/loaders.py) is what runs. An error known to known_issues.py is reported by name.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...stack.known_issues import parse_version
from . import checkpoint, device, known_issues, oracle
from .catalog import BY_TAG, FORMATS, IO_PATHS, Format

TRANSFORMERS_SCHEME = "fine_grained_e4m3fn"  # transformers' own fp8 layout: e4m3fn codes, a float32 scale per block
FIX = ("convert e4m3fn to e4m3fnuz with the 0x80 -> 0x00 rewrite and the scale doubled (gpuregress inspect-fp8 says "
       "how), never by reinterpreting the bytes; report the loader's library and version upstream")


def fix(written: Format, read_as: Format) -> str:
    """What to do about a loader that hands ``written`` bytes back as ``read_as``."""
    if written.counterpart == read_as.id and not written.fnuz:  # the conversion the loader skipped
        return FIX.replace("e4m3fn to e4m3fnuz", f"{written.id} to {read_as.id}")
    return (f"the loader must hand {written.tag} tensors back as torch.{written.torch_name}, never as a view of "
            "their bytes in another format; report the loader's library and version upstream")


def torch_dtype(tag: str) -> torch.dtype:
    return torch.float32 if tag == "F32" else device.torch_dtype(BY_TAG[tag])


def torch_shape(stored: checkpoint.Stored) -> tuple[int, ...]:
    """The tensor's torch shape: fp4 packs two codes into one float4_e2m1fn_x2 element along the last axis."""
    if stored.tag != "F4":
        return stored.shape
    return (*stored.shape[:-1], stored.shape[-1] // 2)


def native(stored: checkpoint.Stored, dev: str) -> torch.Tensor:
    """The codec's tensor as the torch tensor a user holds: fp8 and fp4 dtypes, not uint8."""
    raw = torch.frombuffer(bytearray(stored.data), dtype=torch.uint8).to(dev)  # bytes move; fp4 has no copy kernel
    return raw.view(torch_dtype(stored.tag)).reshape(torch_shape(stored))


def raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def library_version(path: str) -> str:
    """'safetensors 0.8.0': the distribution whose code the path runs, and its installed version."""
    name = {"torch_load": "torch", "dcp": "torch"}.get(path, "safetensors" if path == "safe_open" else path)
    version = known_issues.installed(name)
    return f"{name} {version}" if version else name


@dataclass
class PathResult:
    """What one path did: problems fail its case, known issues warn, ``skipped`` says what it could not try."""

    path: str
    problems: list[str] = field(default_factory=list)
    known_issues: list[str] = field(default_factory=list)
    checked: int = 0  # tensors compared, both ways
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"library": library_version(self.path), "problems": self.problems, "known_issues": self.known_issues,
                "checked": self.checked, "skipped": self.skipped}

    @contextlib.contextmanager
    def attempt(self, scheme: str, call: str, tags: frozenset[str] = frozenset()) -> Iterator[None]:
        """An error of the stack's ``call`` on a file holding ``tags`` is a problem, or the known issue it matches
        (known_issues.py: call, symptom, tag and installed versions); the path goes on."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - whatever the stack raises is the finding (DCP's is a BaseException)
            error = describe_error(exc)
            library = library_version(self.path)
            issue = known_issues.match(library.split()[0], call, error, tags)
            if issue is not None:
                self.known_issues.append(f"{scheme}: {call}: {issue.describe(library.split()[-1])}: {error}")
            else:
                self.problems.append(f"{scheme}: {call} raised {error}")

    def compare(self, scheme: str, call: str, got: Mapping[str, torch.Tensor], want: Mapping[str, checkpoint.Stored]) -> None:
        """Every tensor the stack handed back against the codec's: present, dtype, shape, bytes."""
        self.report(scheme, call, {name: "missing" if got.get(name) is None else mismatch(stored, got[name])
                                   for name, stored in want.items()})

    def compare_file(self, scheme: str, call: str, path: Path, want: Mapping[str, checkpoint.Stored]) -> None:
        """The codec reads the file the stack wrote: every tag, shape and byte as the codec wrote them."""
        written = checkpoint.read(path).tensors
        self.report(scheme, call, {name: file_mismatch(stored, written.get(name)) for name, stored in want.items()})

    def report(self, scheme: str, call: str, problems: Mapping[str, str | None]) -> None:
        """One line per call: how many tensors went wrong, and the first one's problem."""
        self.checked += len(problems)
        bad = [(name, problem) for name, problem in problems.items() if problem]
        if bad:
            name, problem = bad[0]
            self.problems.append(f"{scheme}: {call}: {len(bad)} of {len(problems)} tensors; first {name}: {problem}")


def describe_error(exc: BaseException) -> str:
    """ "Type: first line"; for DCP's CheckpointException, the first rank's own exception, which says what failed."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items(), key=lambda item: str(item[0]))))
        inner = inner[0] if isinstance(inner, tuple) and inner else inner  # (exception, traceback)
        if isinstance(inner, BaseException):
            return f"{type(exc).__name__} (rank {rank}): {describe_error(inner)}"
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def file_mismatch(stored: checkpoint.Stored, mine: checkpoint.Stored | None) -> str | None:
    if mine is None:
        return "not in the file it wrote"
    if (mine.tag, mine.shape) != (stored.tag, stored.shape):
        return f"written as {mine.tag} {list(mine.shape)}, the tensor is {stored.tag} {list(stored.shape)}"
    return None if mine.data == stored.data else differing_bytes(stored.data, mine.data)


def differing_bytes(want: bytes, got: bytes) -> str:
    a, b = np.frombuffer(want, dtype=np.uint8), np.frombuffer(got, dtype=np.uint8)
    if a.size != b.size:
        return f"{b.size} bytes where {a.size} were written"
    wrong = np.flatnonzero(a != b)
    i = int(wrong[0])
    return f"{wrong.size} of {a.size} bytes differ, first at byte {i}: 0x{int(a[i]):02X} written, 0x{int(b[i]):02X} read"


def mismatch(stored: checkpoint.Stored, tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` is not the codec's ``stored`` tensor, naming a format misread and its factor; None if it is."""
    want = torch_dtype(stored.tag)
    if tensor.dtype != want:
        return misread(stored, tensor.dtype)
    if tuple(tensor.shape) != torch_shape(stored):
        return f"shape {list(tensor.shape)}, written {list(torch_shape(stored))}"
    got = raw_bytes(tensor)
    if got == stored.data:
        return None
    return differing_bytes(stored.data, got) + scaled_values(stored, got)


def scaled_values(stored: checkpoint.Stored, got: bytes) -> str:
    """", nearly every value 0.5x ..." when the bytes read back are the written values times one factor: a
    misread somewhere inside the loader whose values were then copied into the right dtype."""
    fmt = BY_TAG.get(stored.tag)
    if fmt is None or fmt.packed or len(got) != len(stored.data):
        return ""
    before = oracle.as_float64(oracle.decode(np.frombuffer(stored.data, dtype=np.uint8), fmt))
    after = oracle.as_float64(oracle.decode(np.frombuffer(got, dtype=np.uint8), fmt))
    usable = np.isfinite(before) & np.isfinite(after) & (before != 0) & (after != 0)
    if usable.sum() < 2:
        return ""
    ratios, counts = np.unique(after[usable] / before[usable], return_counts=True)
    top = float(ratios[int(np.argmax(counts))])
    if counts.max() < 0.99 * usable.sum() or top == 1.0:
        return ""
    return (f"; {int(counts.max())} of {int(usable.sum())} values read back {top:g}x (factor {max(top, 1 / top):g}): "
            f"a misread inside the loader, its values then copied into {fmt.id}")


def misread(stored: checkpoint.Stored, read_as: torch.dtype) -> str:
    text = f"written as {torch_dtype(stored.tag)} ({stored.tag}), read back as {read_as}"
    written = BY_TAG.get(stored.tag)
    other = next((f for f in FORMATS.values() if getattr(torch, f.torch_name, None) == read_as), None)
    if written is None or other is None or other.bits != written.bits or written.packed:
        return text
    codes = np.frombuffer(stored.data, dtype=np.uint8)
    before, after = oracle.decode(codes, written), oracle.decode(codes, other)
    ratio = oracle.value_ratio(before, after)
    if ratio:
        change = f"every value {ratio:g}x (factor {max(ratio, 1 / ratio):g})"
    else:  # e5m2 as e4m3fn: another exponent width, so no one factor; one code shows the size of it
        moved = np.flatnonzero(np.isfinite(before) & (before != 0) & ~oracle.same_values(before, after))
        if not moved.size:
            return text
        i = int(moved[0])
        change = (f"values change by no single factor (code 0x{int(codes[i]):02X} is {float(before[i]):g} in "
                  f"{written.id}, {float(after[i]):g} in {other.id})")
    return f"{text}: the loader reads {written.id} bytes as {other.id}, {change}; fix: {fix(written, other)}"


def via_safetensors(sources: Mapping[str, checkpoint.Checkpoint], folder: Path, dev: str, out: PathResult) -> None:
    import safetensors.torch

    for scheme, ckpt in sources.items():
        written = folder / f"save_file-{scheme}.safetensors"
        with out.attempt(scheme, "save_file", tags_of(ckpt)):
            safetensors.torch.save_file({n: native(s, dev) for n, s in ckpt.tensors.items()}, str(written),
                                        metadata=ckpt.metadata)
            out.compare_file(scheme, "save_file", written, ckpt.tensors)
        with out.attempt(scheme, "load_file", tags_of(ckpt)):
            out.compare(scheme, "load_file", safetensors.torch.load_file(str(ckpt.path), device=dev), ckpt.tensors)


def via_safe_open(sources: Mapping[str, checkpoint.Checkpoint], folder: Path, dev: str, out: PathResult) -> None:
    import safetensors

    for scheme, ckpt in sources.items():
        with out.attempt(scheme, "get_tensor", tags_of(ckpt)), \
                safetensors.safe_open(str(ckpt.path), framework="pt", device=dev) as f:
            out.compare(scheme, "get_tensor", {n: f.get_tensor(n) for n in f.keys()}, ckpt.tensors)
        with out.attempt(scheme, "get_slice", tags_of(ckpt)), \
                safetensors.safe_open(str(ckpt.path), framework="pt", device=dev) as f:
            rows = {n: s for n, s in ckpt.tensors.items() if len(s.shape) >= 1 and s.shape[0] > 0}
            out.compare(scheme, "get_slice[:]", {n: f.get_slice(n)[:] for n in rows}, rows)
            # Where tensor-parallel loaders cut: the first row, rows in the middle, the last row, and columns.
            for label, cut in slice_cuts(rows):
                out.compare(scheme, f"get_slice{label}", {n: f.get_slice(n)[index] for n, (index, _) in cut.items()},
                            {n: expected for n, (_, expected) in cut.items()})


def slice_cuts(tensors: Mapping[str, checkpoint.Stored]) -> list[tuple[str, dict[str, tuple[Any, checkpoint.Stored]]]]:
    """(label, {name: (index for get_slice, the codec's bytes of that part)}) for each kind of cut."""
    cuts: list[tuple[str, dict[str, tuple[Any, checkpoint.Stored]]]] = []
    for label, pick in (("[0:1]", lambda n: slice(0, 1)), ("[mid:mid+2]", lambda n: slice(n // 2, min(n // 2 + 2, n))),
                        ("[-1:]", lambda n: slice(n - 1, n))):
        cuts.append((label, {name: ((pick(s.shape[0]),), part(s, pick(s.shape[0]), None)) for name, s in tensors.items()}))
    wide = {name: s for name, s in tensors.items() if len(s.shape) == 2 and torch_shape(s)[1] >= 4}
    cuts.append(("[:, 1:3]", {name: ((slice(None), slice(1, 3)), part(s, slice(None), slice(1, 3)))
                              for name, s in wide.items()}))
    return cuts


def part(stored: checkpoint.Stored, rows: slice, cols: slice | None) -> checkpoint.Stored:
    """The codec's bytes of ``stored[rows, cols]``, cut in the torch shape (fp4: packed byte columns)."""
    shape = torch_shape(stored)
    itemsize = len(stored.data) // max(1, int(np.prod(shape, dtype=np.int64)))
    grid = np.frombuffer(stored.data, dtype=np.uint8).reshape(*shape, itemsize)
    cut = grid[rows] if cols is None else grid[rows, cols]
    logical = list(cut.shape[:-1])
    if stored.tag == "F4":
        logical[-1] *= 2
    return checkpoint.Stored(stored.name, stored.tag, tuple(logical), np.ascontiguousarray(cut).tobytes())


def tags_of(ckpt: checkpoint.Checkpoint) -> frozenset[str]:
    return frozenset(s.tag for s in ckpt.tensors.values())


def via_torch_load(sources: Mapping[str, checkpoint.Checkpoint], folder: Path, dev: str, out: PathResult) -> None:
    for scheme, ckpt in sources.items():
        written = folder / f"torch_save-{scheme}.pt"
        with out.attempt(scheme, "torch.load", tags_of(ckpt)):
            torch.save({n: native(s, dev) for n, s in ckpt.tensors.items()}, written)
            out.report(scheme, "torch.save", archive_mismatch(written, ckpt.tensors))
            loaded = torch.load(written, weights_only=True, map_location=dev)
            out.compare(scheme, "torch.load(weights_only=True)", loaded, ckpt.tensors)


def archive_mismatch(path: Path, want: Mapping[str, checkpoint.Stored]) -> dict[str, str | None]:
    """Each tensor's bytes among the raw storages of the archive torch.save wrote, read without unpickling: a
    save and load that err in step would pass a round trip, yet the file would be wrong for every other reader."""
    import re
    import zipfile

    with zipfile.ZipFile(path) as archive:
        storages = {archive.read(n) for n in archive.namelist() if re.search(r"/data/\d+$", n)}
    return {name: None if stored.data in storages else "its bytes are in no storage of the archive torch.save wrote"
            for name, stored in want.items()}


def via_dcp(sources: Mapping[str, checkpoint.Checkpoint], run_dir: Path, dev: str, out: PathResult) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    for scheme, ckpt in sources.items():
        folder = run_dir / "formats-dcp" / scheme  # one folder for every rank of the launch
        with out.attempt(scheme, "dcp.load", tags_of(ckpt)), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
            state, mine = _rank_state(ckpt, dev, rank, world, sharded)
            dcp.save(state, checkpoint_id=str(folder))
            target = {name: _empty_like(t) for name, t in state.items()}
            dcp.load(target, checkpoint_id=str(folder))
            local = {n: t.to_local() if isinstance(t, DTensor) else t for n, t in target.items()}
            out.compare(scheme, f"dcp.load (rank {rank} of {world})", local, mine)
        if sharded:
            dist.barrier()
    if rank == 0:
        shutil.rmtree(run_dir / "formats-dcp", ignore_errors=True)


def _rank_state(ckpt: checkpoint.Checkpoint, dev: str, rank: int, world: int,
                sharded: bool) -> tuple[dict[str, torch.Tensor], dict[str, checkpoint.Stored]]:
    """(the state dict this rank saves, the codec's tensors it must read back): its rows of each tensor."""
    state: dict[str, torch.Tensor] = {}
    mine: dict[str, checkpoint.Stored] = {}
    for name, stored in ckpt.tensors.items():
        full = native(stored, dev)
        if not sharded or full.ndim == 0:
            state[name], mine[name] = full, stored
            continue
        rows = stored.shape[0]
        size = -(-rows // world)  # the rows this rank holds under Shard(0): torch.chunk's split, as DTensor's
        start, stop = min(rank * size, rows), min((rank + 1) * size, rows)
        per_row = len(stored.data) // stored.shape[0]
        mine[name] = checkpoint.Stored(name, stored.tag, (stop - start, *stored.shape[1:]),
                                       stored.data[start * per_row: stop * per_row])
        state[name] = _shard(full, start, stop)
    return state, mine


def _shard(full: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(full.device.type, (dist.get_world_size(),))
    return DTensor.from_local(full[start:stop], mesh, [Shard(0)], run_check=False,
                              shape=full.shape, stride=full.stride())


def _empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """A load target of the same layout, filled with a byte no checkpoint tensor here is made of."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local = _empty_like(tensor.to_local())
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())
    filled = torch.full((tensor.numel() * tensor.element_size(),), 0x5A, dtype=torch.uint8, device=tensor.device)
    return filled.view(tensor.dtype).reshape(tensor.shape)


BLOCK = 16  # transformers' fine-grained fp8 layout with small blocks: every weight has many scales, each its own


@dataclass(frozen=True)
class BlockQuantized:
    """One weight in transformers' fine-grained fp8 layout, quantized by the oracle: e4m3fn codes, one float32
    scale per BLOCK x BLOCK block (value = code x scale), and the exact dequantized values."""

    codes: checkpoint.Stored
    scales: checkpoint.Stored
    values: np.ndarray  # float32: the float64 product of each code and its block's scale, rounded once


def block_quantize(name: str, weight: np.ndarray) -> BlockQuantized:
    fmt = FORMATS["e4m3fn"]
    top = float(oracle.limits(fmt).max)
    rows, cols = weight.shape
    blocks = weight.astype(np.float32).reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=(1, 3))
    scales = np.where(amax > 0, amax / np.float32(top), np.float32(1)).astype(np.float32)
    spread = scales[:, None, :, None]
    codes = oracle.encode(np.clip(blocks / spread, -top, top).astype(np.float32), fmt).reshape(rows, cols)
    values = (oracle.as_float64(oracle.decode(codes, fmt)).reshape(blocks.shape) * spread).astype(np.float32)
    return BlockQuantized(checkpoint.Stored(name, "F8_E4M3", (rows, cols), codes.astype(np.uint8).tobytes()),
                          checkpoint.Stored(f"{name}_scale_inv", "F32", scales.shape, scales.astype("<f4").tobytes()),
                          values.reshape(rows, cols))


def via_transformers(model: Any, folder: Path, dev: str, out: PathResult) -> None:
    """The decoder layers' linear weights as transformers' fine-grained fp8 checkpoint (many blocks per weight,
    each with its own scale), written by save_pretrained and read back by from_pretrained."""
    out.skipped = _transformers_skip()
    if out.skipped:
        return
    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    quantized = {n: block_quantize(n, t.numpy()) for n, t in state.items() if _block_quantizable(n, t)}
    want: dict[str, checkpoint.Stored] = {}
    for name, q in quantized.items():
        state[name], state[q.scales.name] = native(q.codes, "cpu"), native(q.scales, "cpu")
        want[name], want[q.scales.name] = q.codes, q.scales
    saved = folder / "transformers-fp8"
    _save_pretrained(model, saved, state, want, out)
    if not (saved / "model.safetensors").is_file():
        return
    loaded = _from_pretrained(model, saved, out)
    if loaded is not None:
        params = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
        out.report(TRANSFORMERS_SCHEME, "from_pretrained",
                   {name: loaded_mismatch(name, q, params) for name, q in quantized.items()})


def _transformers_skip() -> str | None:
    """Why this rank cannot check the transformers path, or None."""
    import torch.distributed as dist
    import transformers

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return "under torch.distributed, save_pretrained writes on rank 0 only: rank 0 checks this path"
    try:
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
    except ImportError:
        AUTO_QUANTIZER_MAPPING = {}
    if "fp8" not in AUTO_QUANTIZER_MAPPING:
        return f"transformers {transformers.__version__} has no fine-grained fp8 loader (quant_method fp8)"
    return None


def _block_quantizable(name: str, weight: torch.Tensor) -> bool:
    """A decoder layer's linear weight whose sides are whole blocks."""
    return ".layers." in name and name.endswith("proj.weight") and weight.ndim == 2 \
        and all(d % BLOCK == 0 for d in weight.shape)


def _save_pretrained(model: Any, saved: Path, state: dict[str, torch.Tensor], want: dict[str, checkpoint.Stored],
                     out: PathResult) -> None:
    """save_pretrained with the fp8 quantization config, the file it wrote checked against the oracle's tensors."""
    scheme = TRANSFORMERS_SCHEME
    config = copy.deepcopy(model.config)
    config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    original, model.config = model.config, config
    try:
        with out.attempt(scheme, "save_pretrained"):
            model.save_pretrained(str(saved), state_dict=dict(state))  # it pops from the dict it is given
            if not (saved / "model.safetensors").is_file():
                out.problems.append(f"{scheme}: save_pretrained wrote no model.safetensors into {saved}")
                return
            out.compare_file(scheme, "save_pretrained", saved / "model.safetensors", want)
    finally:
        model.config = original


def _from_pretrained(model: Any, saved: Path, out: PathResult) -> Any:
    """The model from_pretrained loads from ``saved``, or None where it raised (a problem, or the skip of a release
    that loads fp8 only on an accelerator)."""
    import transformers

    dtype_key = "dtype" if parse_version(transformers.__version__) >= parse_version("4.56") else "torch_dtype"
    try:
        return type(model).from_pretrained(str(saved), local_files_only=True, **{dtype_key: torch.float32})
    except Exception as exc:  # noqa: BLE001 - the stack's refusal is the finding, but for one it states plainly
        text = describe_error(exc)
        if "No GPU or XPU found" in text:  # releases that only dequantize on an accelerator
            out.skipped = f"transformers {transformers.__version__} loads fp8 checkpoints only on a GPU: {text}"
        else:
            out.problems.append(f"{TRANSFORMERS_SCHEME}: from_pretrained raised {text}")
        return None


def loaded_mismatch(name: str, q: BlockQuantized, params: Mapping[str, torch.Tensor]) -> str | None:
    """A weight from_pretrained loaded against the oracle's: kept in fp8 (a GPU with fp8 matmul) byte for byte
    with its block scales; dequantized (a CPU) value for value against the oracle's code x block scale."""
    got = params.get(name)
    if got is None:
        return "missing"
    if got.dtype.itemsize == 1:
        scale = params.get(q.scales.name)
        if scale is None or raw_bytes(scale) != q.scales.data:
            return "its weight_scale_inv is missing or differs from the one written"
        return mismatch(q.codes, got)
    return _dequantized_mismatch(q, got.detach().float().cpu().numpy())


def _dequantized_mismatch(q: BlockQuantized, values: np.ndarray) -> str | None:
    """Dequantized weights against the oracle's code x block scale, naming the format the loader read, if one."""
    wrong = ~oracle.same_values(q.values, values)
    if not wrong.any():
        return None
    i = int(np.flatnonzero(wrong)[0])
    text = (f"{int(wrong.sum())} of {wrong.size} dequantized values differ from the oracle's code x block scale, "
            f"first at {tuple(int(k) for k in np.unravel_index(i, wrong.shape))}: {float(q.values.reshape(-1)[i])!r} "
            f"expected, {float(values.reshape(-1)[i])!r} read")
    ratio = oracle.value_ratio(q.values, values)
    if ratio:
        codes = np.frombuffer(q.codes.data, dtype=np.uint8).reshape(q.codes.shape)
        read_as = next((f for f in FORMATS.values() if f.bits == 8 and f.id != "e4m3fn"
                        and oracle.same_values(_dequantized_as(codes, q, f), values).all()), None)
        named = f"reads e4m3fn bytes as {read_as.id}, " if read_as is not None else ""
        text += f": the loader {named}every value {ratio:g}x (factor {max(ratio, 1 / ratio):g}); fix: {FIX}"
    return text


def _dequantized_as(codes: np.ndarray, q: BlockQuantized, fmt: Any) -> np.ndarray:
    """The codes read as ``fmt``, times their block's scale: exact in float64, rounded once."""
    rows, cols = codes.shape
    scales = np.frombuffer(q.scales.data, dtype="<f4").reshape(rows // BLOCK, cols // BLOCK)
    spread = np.repeat(np.repeat(scales, BLOCK, axis=0), BLOCK, axis=1).astype(np.float64)
    return (oracle.as_float64(oracle.decode(codes, fmt)) * spread).astype(np.float32)


def run(paths: list[str], sources: Mapping[str, checkpoint.Checkpoint], model: Any, dev: str, folder: Path,
        run_dir: Path) -> dict[str, Any]:
    """{path: PathResult.as_dict()} for the selected ``paths``; ``sources``: the codec's file per scheme."""
    results: dict[str, Any] = {}
    readers = {"safetensors": lambda out: via_safetensors(sources, folder, dev, out),
               "safe_open": lambda out: via_safe_open(sources, folder, dev, out),
               "torch_load": lambda out: via_torch_load(sources, folder, dev, out),
               "dcp": lambda out: via_dcp(sources, run_dir, dev, out),
               "transformers": lambda out: via_transformers(model, folder, dev, out)}
    for path in (p for p in IO_PATHS if p in paths):
        out = PathResult(path)
        readers[path](out)
        results[path] = out.as_dict()
    return results
