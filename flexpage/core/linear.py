"""Linear layers of paged forwards through whichever CPU GEMM is fastest for their shape.

A paged step multiplies every linear layer's weight by a few rows (a decode step: one per
sequence) or a few hundred (a prefill chunk). On the CPU the same float32 or bfloat16 product runs
at very different speeds through different kernels, and which one wins depends on the CPU and the
row count: MKL's ``x @ W.T``, MKL's ``(W @ x.T).T``, oneDNN's matmul on the weight as it is,
flexpage's own few-row kernel (``kernels.row_linear``: float32 on AVX2/AVX-512 cores; bfloat16
by dot products on AVX512-BF16 cores, widened to float32 in registers elsewhere) and, for bfloat16
on CPUs without bfloat16 instructions, float32 GEMMs over the weight widened a tile at a time
(``widened_linear``). Only kernels this CPU's tier and torch build run are offered (``candidates``,
``cpu``); one that fails anyway is ranked last. So ``fast_linear`` times the offered kernels,
alternated, on the first calls that meet a weight shape with a given number of rows (rounded up
to a power of two), and uses the fastest by median from then on (``rank``: ``F.linear``, the stock
model's product, unless another is clearly faster), in this process and, through
``rankings_file()``, in later ones on a CPU of the same instruction sets and caches with this
torch. The timed calls are the model's own, so each weight is as cold in cache as a forward
leaves it: a weight timed in a loop stays hot in cache and ranks the kernels otherwise than a
forward does.
Results differ from ``F.linear``'s in the last bits, as paged attention's already do from SDPA's.
``FewRowLinears`` routes a model's ``nn.Linear`` layers through it for forwards through a paged
cache only (a flag set by a hook on the model), so a wrapped model's plain forward (scoring,
training) stays bit-for-bit the stock one. ``FewRowLinears.pack`` also keeps a copy of each weight
in oneDNN's blocked layout, which oneDNN reads faster still: a second copy of every CPU weight,
which the Engine takes by default when it fits (``packing_fits``: at most ``PACK_MEMORY_SHARE`` of
the memory available), as a server takes its KV pool up front.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from . import cpu, kernels
from .compile import artifact_dir

log = logging.getLogger(__name__)

MAX_ROWS = 1 << 16  # a batched prefill's rows (b8 x 1024 tokens: oneDNN 25% faster than F.linear); above, F.linear untimed
PACK_MEMORY_SHARE = 0.25  # packed copies are taken by default when they need at most this share of free memory
TRIALS = 4  # calls timed with each kernel, alternated, before a (weight shape, row bucket) is decided
MARGIN = 0.05  # a kernel displaces F.linear only where its median call is this much faster (noise is not a win)
WIDEN_TILE_BYTES = 1 << 25  # ``widened_linear``'s float32 tile of a weight: widened in cache, read from it
ROW_KERNEL_ROWS = 16  # the few-row kernel is timed up to this row bucket (the library GEMMs win from 8-32 rows)

# (out_features, in_features, has bias, row bucket, threads, dtype name, packed)
Key = tuple[int, int, bool, int, int, str, bool]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the dtypes whose products are timed
Kernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
ranking: dict[Key, tuple[str, ...]] = {}  # decided keys -> kernel names, fastest first
trials: dict[Key, dict[str, list[float]]] = {}  # keys on trial -> seconds of each kernel's timed calls


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``: the model's own product (MKL's ``x @ W.T`` on x86 CPUs)."""
    return F.linear(x, weight, bias)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ rows.T).T``. A single row goes in as
    two copies of itself: MKL's two-column GEMM reads a weight faster than its matrix-vector
    product on some CPUs. The copies come from ``torch.cat``, several times cheaper than
    ``repeat`` (a lone decode token takes this path in most of a step's linear layers)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat])
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias[:, None], weight, flat.t())
    return out[:, :rows].t().contiguous().view(*x.shape[:-1], weight.shape[0])


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN's matmul, on the weight as it is (no packed copy).
    Eager and without autograd only: inductor cannot trace it on an unpacked weight."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache  # an eager decode step asks for every linear layer
def row_linear_kernel() -> Kernel:
    """What an eager product by the few-row kernel calls: ``flexpage::row_linear`` where its C++
    kernel loaded (``kernels.native_ops``: a call costs about what ``F.linear``'s dispatch does),
    else ``kernels.row_linear`` directly (cheaper than the op through Python)."""
    return torch.ops.flexpage.row_linear.default if kernels.native_ops() else kernels.row_linear


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` by flexpage's few-row kernel: the weight streamed once for all rows; one opaque
    op in a traced forward (its kernel given when the few-row kernel was found available)."""
    if torch.compiler.is_compiling():
        return torch.ops.flexpage.row_linear.default(x, weight, bias)
    return row_linear_kernel()(x, weight, bias)


_scratch = threading.local()  # each thread's float32 scratches for ``widened_linear``: weight tiles, rows


def _scratch_of(name: str, numel: int) -> torch.Tensor:
    """This thread's float32 scratch ``name`` of at least ``numel`` values (grown, never shrunk):
    reused memory, where a new tensor each call would fault its pages in anew."""
    scratch = getattr(_scratch, name, None)
    if scratch is None or scratch.numel() < numel:
        scratch = torch.empty(numel)
        setattr(_scratch, name, scratch)
    return scratch[:numel]


@torch.library.custom_op("flexpage::widened_linear", mutates_args=())
def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bfloat16 tensors by float32 GEMMs: the weight widened a tile at a time into a
    reused float32 scratch, the rows once, the output rounded to bfloat16 once. Where the CPU has
    no bfloat16 instructions its bfloat16 GEMMs run several times slower than float32 ones; this
    costs float32's time plus a widening copy that stays in cache. One opaque op in a traced forward."""
    rows, width = x.numel() // x.shape[-1], x.shape[-1]
    tile = min(max(1, WIDEN_TILE_BYTES // (4 * width)), weight.shape[0])
    flat = x.reshape(rows, width)
    flat = (_scratch_of("rows", rows * width).view(rows, width).copy_(flat) if 4 * rows * width <= WIDEN_TILE_BYTES
            else flat.float())  # a batched prefill's many rows: no scratch kept that large
    scratch = _scratch_of("weight", tile * width)
    parts = []
    for first in range(0, weight.shape[0], tile):
        part = weight[first:first + tile]
        wide = scratch[:part.numel()].view(part.shape).copy_(part)
        wide_bias = None if bias is None else bias[first:first + tile].float()
        parts.append((onednn_linear if "onednn" in KERNELS else F.linear)(flat, wide, wide_bias).to(x.dtype))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out.view(*x.shape[:-1], weight.shape[0])


KERNELS: dict[str, Kernel] = {"plain": plain_linear, "transposed": transposed_linear}
if torch.backends.mkldnn.is_available():
    KERNELS["onednn"] = onednn_linear
    KERNELS["onednn_packed"] = onednn_linear  # given the layer's packed copy (``pack_weight``) as its weight
KERNELS["rows"] = row_linear  # for the dtypes ``kernels.row_linear_available`` names
KERNELS["widened"] = widened_linear  # bfloat16 on CPUs without bfloat16 instructions
TRACEABLE = ("plain", "transposed", "onednn_packed", "rows", "widened")  # the kernels a compiled forward can take
# packed copies a compiled forward reads through ``flexpage::packed_linear``, by their weight's address
_PACKED: dict[int, tuple["FewRowLinears", nn.Linear]] = {}


@torch.library.custom_op("flexpage::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by oneDNN on ``weight``'s packed copy (``FewRowLinears.pack``),
    as one opaque op of a compiled forward: inductor cannot trace oneDNN on the copy, and its own
    GEMMs read a weight for a few rows several times slower. The copy is found by the weight's
    address, so a graph saved by one process serves another's weights."""
    owner = _PACKED.get(weight.data_ptr())
    if owner is None or owner[1].weight.data_ptr() != weight.data_ptr():  # not a packed layer's weight
        return F.linear(x, weight, bias)
    linears, layer = owner
    return onednn_linear(x, linears.packed(layer), bias)


@packed_linear.register_fake
@widened_linear.register_fake
def _linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def pack_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """A copy of a float32 CPU ``weight`` in oneDNN's blocked layout, laid out for products of
    about ``rows`` rows (any row count works), for the ``onednn_packed`` kernel."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def available_memory() -> int:
    """Bytes of memory the system can still give this process without swapping."""
    return psutil.virtual_memory().available


def candidates(packed: bool, dtype: torch.dtype = torch.float32, bucket: int = 1) -> tuple[str, ...]:
    """The kernels timed for a layer of ``dtype`` at a row bucket, by what this CPU and torch build
    run (``cpu``): ``F.linear`` always; with a packed copy, oneDNN runs on it instead of the weight;
    oneDNN's bfloat16 only where its build has it for this tier; bfloat16 widened to float32 GEMMs
    where the tier has no bfloat16 instructions; flexpage's few-row kernel where it is built for
    ``dtype``, up to ``ROW_KERNEL_ROWS`` rows."""
    skip = {"onednn" if packed else "onednn_packed"}
    if dtype == torch.bfloat16 and not cpu.onednn_bf16():
        skip.add("onednn")
    if dtype != torch.bfloat16 or cpu.native_bf16():
        skip.add("widened")
    if (bucket > ROW_KERNEL_ROWS or dtype not in kernels.ROW_LINEARS
            or not _row_kernels() & kernels.ROW_LINEARS[dtype][1]):
        skip.add("rows")
    return tuple(name for name in KERNELS if name not in skip)


@torch.compiler.assume_constant_result
def _row_kernels() -> int:
    """The dtypes ``kernels.row_linear`` runs for here, as their bits in ``kernels.ROW_LINEARS``."""
    bits = sum(bit for dtype, (_, bit) in kernels.ROW_LINEARS.items() if kernels.row_linear_available(dtype))
    if bits:  # before any forward is traced or a saved graph loaded: the op's kernel, for the graphs to call
        row_linear_kernel()
    return bits


def row_key(rows: int, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool = False) -> Key:
    """The key under which a product of ``rows`` rows through ``weight`` (with a packed copy or
    not) is decided, on as many threads as torch uses now."""
    return (weight.shape[0], weight.shape[1], bias is not None, 1 << (rows - 1).bit_length(), _threads(),
            str(weight.dtype).removeprefix("torch."), packed)


@torch.compiler.assume_constant_result  # a trace takes the count it was traced at, as a constant
def _threads() -> int:
    return torch.get_num_threads()


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 or bfloat16 CPU inputs of 1..``MAX_ROWS`` rows, without
    autograd, through the kernel measured fastest for this weight shape and row bucket (timing
    this very call while that is undecided); otherwise ``F.linear``. ``packed`` is the weight's
    ``pack_weight`` copy, if it has one. A compiled forward takes the fastest traceable kernel
    measured beforehand, or ``F.linear`` if none was."""
    if not _chooses(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():  # nothing to time while tracing: the kernel measured beforehand
        return traced_linear(x, weight, bias, packed is not None)
    key = row_key(x.numel() // x.shape[-1], weight, bias, packed is not None)
    order = ranking.get(key)
    if order is None:
        return _timed(key, x, weight, bias, packed)
    return _run(order[0], x, weight, bias, packed)


def _chooses(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``fast_linear`` picks a kernel for this product (else it is ``F.linear``'s)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (1 <= rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == weight.dtype
            and x.dtype in DTYPES.values() and (bias is None or bias.dtype == x.dtype)
            and weight.is_contiguous() and not torch.is_grad_enabled())


def traced_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> torch.Tensor:
    """The product a traced forward bakes in: the kernel ``traced_kernel`` names, the packed copy
    (``packed``: the layer has one) read at run time through ``packed_linear``."""
    name = traced_kernel(x.numel() // x.shape[-1], weight, bias, packed)
    if name == "onednn_packed":
        return packed_linear(x, weight, bias)
    return KERNELS[name](x, weight, bias)


def traced_kernel(rows: int, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> str:
    """The kernel a traced product of ``rows`` rows takes: the fastest traceable one measured (the
    packed copy only where the layer has one, through ``packed_linear``), else ``F.linear``."""
    order = ranking.get(row_key(rows, weight, bias, packed)) or ()
    return next((name for name in order if name in TRACEABLE and (packed or name != "onednn_packed")), "plain")


def _run(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         packed: torch.Tensor | None) -> torch.Tensor:
    """The product by kernel ``name``, which takes the packed copy where it is the packed kernel."""
    return KERNELS[name](x, packed if name == "onednn_packed" else weight, bias)


def _timed(key: Key, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """The product by the kernel ``key`` has timed fewest calls of, timed; once every kernel has
    ``TRIALS`` calls ``key`` is decided (``rank``). A kernel that fails is ranked last with one
    logged line and the call goes to another (``F.linear``'s failures are the caller's)."""
    times = trials.setdefault(key, {name: [] for name in candidates(packed is not None, weight.dtype, key[3])})
    name = min(times, key=lambda name: len(times[name]))
    start = time.perf_counter()
    try:
        out = _run(name, x, weight, bias, packed)
    except RuntimeError as error:
        if name == "plain":
            raise
        log.warning("flexpage: linear kernel %s failed for %s (%s); not offered for it", name, key,
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        times[name] = [math.inf] * TRIALS  # ranked last, after F.linear, so never run
        return _timed(key, x, weight, bias, packed)
    times[name].append(time.perf_counter() - start)
    if all(len(seconds) == TRIALS for seconds in times.values()):
        ranking[key] = rank(times)
        del trials[key]
        save_rankings()
    return out


def rank(times: dict[str, list[float]]) -> tuple[str, ...]:
    """Kernel names, fastest first, by their median timed call; ``F.linear`` ("plain", the stock
    model's product) stays first unless another's median is ``MARGIN`` below its own, so a ranking
    made on noise never runs slower than the model it wraps."""
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    order = sorted(medians, key=medians.get)
    if "plain" in medians and medians[order[0]] > (1 - MARGIN) * medians["plain"]:
        order.remove("plain")
        order.insert(0, "plain")
    return tuple(order)


def rankings_file() -> Path:
    """Where decided rankings are kept between processes: next to flexpage's saved graphs."""
    return artifact_dir() / "linear-kernels.json"


def _machine() -> str:
    """What rankings are kept under: what decides them on this CPU (``cpu.signature``: its tier,
    instruction sets and caches), torch, the kernels timed and their sources (the few-row kernel's
    and this module's: rankings measured with an earlier version are not taken)."""
    return (f"{cpu.signature()} | torch {torch.__version__} | {', '.join(KERNELS)} | "
            f"rows {kernels.source_digest('row_linear.c', 'ops.cpp', 'linear.py')}")


def load_rankings() -> None:
    """Take the rankings an earlier process decided on this CPU with this torch and these kernels
    (``_machine``; an autotuning cache: a new process then times nothing it already knows; delete
    the file to re-measure)."""
    try:
        saved = json.loads(rankings_file().read_text())[_machine()]
        found = {}
        for key, names in saved.items():
            *sizes, dtype, packed = key.split(",")
            out, inp, bias, bucket, threads = (int(part) for part in sizes)
            if sorted(names) == sorted(candidates(bool(int(packed)), DTYPES[dtype], bucket)):
                found[out, inp, bool(bias), bucket, threads, dtype, bool(int(packed))] = tuple(names)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none saved, or not ours to read
        return
    for key, names in found.items():
        ranking.setdefault(key, names)


def save_rankings() -> None:
    """Merge this process's rankings into the rankings file (atomically: processes may share it)."""
    path = rankings_file()
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    if not isinstance(saved, dict) or not isinstance(saved.get(_machine(), {}), dict):
        saved = {}  # a file not in this format is replaced
    mine = saved.setdefault(_machine(), {})
    mine.update({",".join(str(part if isinstance(part, str) else int(part)) for part in key): list(names)
                 for key, names in ranking.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(saved, f)
        os.replace(f.name, path)
    except OSError:  # a read-only cache folder: rankings are measured again by the next process
        pass


class FewRowLinears:
    """Route ``model``'s plain ``nn.Linear`` layers through ``fast_linear`` during the
    forwards ``is_paged(kwargs)`` accepts. Layers off the CPU, layers whose ``forward`` is
    already replaced on the instance (accelerate's offload hooks) and tensor-parallel (DTensor)
    weights are left alone. A compiled forward takes the traceable kernel measured fastest
    beforehand (``measure``), else inductor's own GEMM.

    ``pack(rows)`` adds oneDNN on packed copies of the weights."""

    def __init__(self, model: nn.Module, is_paged: Callable[[dict], bool]) -> None:
        self.active = False
        self._is_paged = is_paged
        self.pack_rows = 0
        self.layers = [
            module for module in model.modules()
            if type(module) is nn.Linear and "forward" not in vars(module) and type(module.weight) is nn.Parameter
            and module.weight.device.type == "cpu"  # elsewhere the layer keeps its own forward (no per-call cost)
        ]
        # layer -> (the weight it was packed from, that weight's version then, the packed copy)
        self._packed: dict[nn.Linear, tuple[torch.Tensor, int, torch.Tensor]] = {}
        for layer in self.layers:
            layer.forward = types.MethodType(self._forward, layer)
        if self.layers:
            load_rankings()
        self._hooks = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def packing_fits(self) -> bool:
        """Whether packed copies can be taken by default: oneDNN is there and the copies (as many
        bytes as the float32 layers' weights) need at most ``PACK_MEMORY_SHARE`` of the memory
        available now."""
        copy = sum(layer.weight.nbytes for layer in self.layers if layer.weight.dtype == torch.float32)
        return "onednn_packed" in KERNELS and 0 < copy <= PACK_MEMORY_SHARE * available_memory()

    def pack(self, rows: int) -> None:
        """Keep a ``pack_weight`` copy of each float32 layer's weight for products of about
        ``rows`` rows (a second copy of the weights), taken now and again whenever the weight is
        replaced or changed in place (``load_state_dict``, an optimizer step)."""
        if "onednn_packed" not in KERNELS:
            raise ValueError("packed weights need a torch built with oneDNN (torch.backends.mkldnn)")
        self.pack_rows = rows
        for layer in self.layers:
            self.packed(layer)

    @property
    def packed_bytes(self) -> int:
        """Memory held by the packed copies."""
        return sum(copy.numel() * copy.element_size() for _, _, copy in self._packed.values())

    def measure(self, max_rows: int) -> None:
        """Decide now every weight shape's kernel at each row bucket up to ``max_rows``, for a
        forward that cannot time its own calls (``wrap(compile_decode=True)``: its decode forward
        is traced, not run): random rows go through the layers in model order, as in a forward
        (each weight as cold in cache), sweep after sweep until every such key is decided."""
        layers = [layer for layer in self.layers if layer.weight.dtype in DTYPES.values()]
        with torch.no_grad():
            for bucket in range((min(max_rows, MAX_ROWS) - 1).bit_length() + 1):
                for _ in range(len(KERNELS) * TRIALS):  # a shape met once per sweep is decided after the last
                    for layer in layers:
                        packed = self.packed(layer)
                        if row_key(1 << bucket, layer.weight, layer.bias, packed is not None) not in ranking:
                            fast_linear(torch.randn(1 << bucket, layer.in_features, dtype=layer.weight.dtype),
                                        layer.weight, layer.bias, packed)

    def traced_kernels(self, rows: int) -> tuple[str, ...]:
        """The kernel a traced forward of ``rows`` rows takes in each layer (``fast_linear``): what a
        compiled graph bakes in, so part of what a saved graph is keyed by."""
        return tuple(traced_kernel(rows, layer.weight, layer.bias, self.packs(layer))
                     for layer in self.layers)

    def remove(self) -> None:
        """Give every layer back its class's ``forward`` and drop the hooks."""
        for layer in self.layers:
            del layer.forward
        for hook in self._hooks:
            hook.remove()
        self.layers, self.active = [], False
        for weight, _, _ in self._packed.values():
            _PACKED.pop(weight.data_ptr(), None)
        self._packed.clear()

    def packs(self, layer: nn.Linear) -> bool:
        """Whether ``layer`` has a packed copy: weights are packed and this one is float32."""
        return self.pack_rows > 0 and layer.weight.dtype == torch.float32

    def packed(self, layer: nn.Linear) -> torch.Tensor | None:
        """``layer``'s packed weight (re-packed if the weight changed since), or None where it has
        none (``packs``)."""
        if not self.packs(layer):
            return None
        weight = layer.weight
        entry = self._packed.get(layer)
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            entry = self._packed[layer] = (weight, weight._version, pack_weight(weight, self.pack_rows))
            _PACKED[weight.data_ptr()] = (self, layer)
        return entry[2]

    def _forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return F.linear(x, layer.weight, layer.bias)
        if torch.compiler.is_compiling() and _chooses(x, layer.weight, layer.bias):
            # the kernel measured for this layer as it is, packed or not (its copy is not traced)
            return traced_linear(x, layer.weight, layer.bias, self.packs(layer))
        return fast_linear(x, layer.weight, layer.bias, self.packed(layer))

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.active = self._is_paged(kwargs)

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.active = False
