"""C kernels for the CPU, compiled on first use: decode attention over pages, few-row linears.

PyTorch's CPU attention takes keys in the query's dtype only, so int8 and float8 pages had to be
dequantised into a float scratch before SDPA read them (an extra write and read of float32 per
key), and its kernels, made for blocks of queries, spend on a decode token's few query rows about
twice the time it takes to read float32 keys. ``decode_attention.c`` reads the stored values
(float32, bfloat16, int8 or float8 with their scales) in place, each key converted once for every
query head of its KV head, a batch of decode tokens in one call. It is compiled with the system's
C compiler for this machine's instruction set (as inductor compiles its CPU kernels), cached
beside flexpage's compiled graphs, and loaded with ``ctypes``; its OpenMP threads are torch's own
(the same ``libgomp`` is already loaded). Where it cannot be built, ``decode_attention`` returns
None and the caller takes SDPA or FlexAttention (over dequantised keys for quantised pages).

``row_linear.c`` multiplies a few float32 or bfloat16 rows by a weight, reading the weight once
(``row_linear``; ``linear.fast_linear`` times it against the library GEMMs): float32 with fused
multiply-adds (AVX2 or AVX-512), bfloat16 with AVX512-BF16 dot products, or on cores without them
each value widened to float32 in registers. It is built the same way, and offered for the dtypes
its build covers on this CPU (``row_linear_available``). Every library is built for the tier
flexpage acts on (``cpu.march``: ``native``, or a lower tier's ``-march`` where one is forced). ``ops.cpp`` holds
the C++ kernels of two ops over them (``native_ops``, built with the system C++ compiler against
torch's stable C++ API, whose headers compile in a fraction of ATen's time; torch 2.10 or later,
else the fallbacks below): ``flexpage::row_linear`` and ``flexpage::paged_decode`` (decode tokens'
attention, their keys found through the page table), which eager and compiled steps call without
entering Python.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from . import cpu
from .compile import artifact_dir
from .host import cdiv
from .quant import value_dim

log = logging.getLogger(__name__)

Signature = tuple[list, type]  # an entry point's ctypes argument types and result type
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
# each kernel library: its entry points' signatures
ENTRY_POINTS: dict[str, dict[str, Signature]] = {
    "decode_attention": {"flexpage_decode_attention": (
        [_POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE, _SIZE, _SIZE, _POINTER, _POINTER, _POINTER,
         ctypes.c_float, ctypes.c_float, _SIZE, ctypes.c_int, ctypes.c_int, _POINTER], ctypes.c_int)},
    "row_linear": {"flexpage_f32_linear": ([_POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE, _POINTER], ctypes.c_int),
                   "flexpage_bf16_linear": ([_POINTER, _POINTER, _POINTER, _SIZE, _SIZE, _SIZE, _POINTER], ctypes.c_int),
                   "flexpage_row_linear_formats": ([], ctypes.c_int)},
}
# the kernel's ``enum format`` for each pool dtype it reads
FORMATS = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float32: 2, torch.bfloat16: 3}
# -ffast-math's value-changing parts only: a shared library linked with -ffast-math itself sets the
# CPU's flush-to-zero and denormals-are-zero modes when it is loaded, for the whole process
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-freciprocal-math", "-fopenmp", "-shared", "-fPIC")
PART_KEYS = 256  # fewest keys a thread's part takes: a part's merge costs a few vectors


def flags() -> tuple[str, ...]:
    """``FLAGS`` with the instruction set built for: the tier flexpage acts on (``cpu.march``)."""
    return (*FLAGS, f"-march={cpu.march()}")


_lock = threading.Lock()
# per (library, compiler, -march): the loaded library, or None where it failed
_libraries: dict[tuple[str, str | None, str], ctypes.CDLL | None] = {}


def compiler() -> str | None:
    """The C compiler kernels are built with (``$CC``, else ``cc`` or ``gcc`` on the path)."""
    return os.environ.get("CC") or _path_compiler()


@functools.cache
def _path_compiler() -> str | None:  # searched once: a decode step asks for every layer
    return shutil.which("cc") or shutil.which("gcc")


def _build(name: str, cc: str) -> Path:
    """Library ``name``'s shared object, compiled unless this source, compiler and CPU built it before."""
    source = Path(__file__).with_name(f"{name}.c")

    def build(scratch: Path, built: Path) -> None:
        run_commands([cc, *flags(), "-o", str(built), str(source), "-lm"])

    return _built(name, [source.read_bytes(), cc.encode(), " ".join(flags()).encode()], build)


@functools.cache  # asked each time rankings are saved
def source_digest(*names: str) -> str:
    """A short digest of these sources beside this file (``row_linear.c``, ``ops.cpp``): what a
    measurement of their kernels is only valid for."""
    digest = hashlib.sha256(b"\0".join(Path(__file__).with_name(name).read_bytes() for name in names))
    return digest.hexdigest()[:12]


def _built(name: str, inputs: list[bytes], build: Callable[[Path, Path], None]) -> Path:
    """The cached shared object ``name`` of ``inputs`` (sources, compilers, flags) for this CPU:
    ``build(scratch folder, path)`` makes it the first time, aside, then it is moved in whole."""
    # a library built with ``-march=native`` runs only where the flags are the same (a cache folder may be shared)
    digest = hashlib.sha256(b"\0".join([*inputs, " ".join(sorted(cpu.cpu_flags())).encode()]))
    path = artifact_dir() / "kernels" / f"{name}-{digest.hexdigest()[:16]}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        build(Path(scratch), built)
        os.replace(built, path)
    return path


def run_commands(*commands: list[str], timeout: float = 300) -> None:
    """Run ``commands`` side by side (compiles of separate sources) within ``timeout`` seconds;
    ``CalledProcessError`` for the first that fails, with its output. None is left running: where
    one cannot start or time runs out, those started are stopped."""
    running: list[tuple[list[str], subprocess.Popen]] = []
    deadline = time.monotonic() + timeout
    failed = None
    try:
        for command in commands:
            running.append((command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      text=True)))
        for command, process in running:
            try:
                out, err = process.communicate(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            if process.returncode and failed is None:
                failed = subprocess.CalledProcessError(process.returncode, command, out, err)
    finally:
        for _, process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
    if failed is not None:
        raise failed


def library(name: str = "decode_attention") -> ctypes.CDLL | None:
    """Kernel library ``name`` (a key of ``ENTRY_POINTS``), built on first use by ``compiler()``;
    None where it cannot be (no C compiler, a failed build: logged once per library and compiler)."""
    key = name, compiler(), cpu.march()
    if key not in _libraries:
        with _lock:
            if key not in _libraries:
                _libraries[key] = _load(*key)
    return _libraries[key]


def _load(name: str, cc: str | None, march: str) -> ctypes.CDLL | None:
    try:
        if cc is None:
            raise FileNotFoundError("no C compiler on the path (set $CC)")
        lib = ctypes.CDLL(str(_build(name, cc)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning("flexpage: the C kernel %s could not be built (%s); %s", name, detail, FALLBACKS[name])
        return None
    for entry, (argtypes, restype) in ENTRY_POINTS[name].items():
        getattr(lib, entry).argtypes, getattr(lib, entry).restype = argtypes, restype
    return lib


FALLBACKS = {"decode_attention": "decode tokens are attended by SDPA (quantised pages dequantised first)",
             "row_linear": "linears keep the library GEMMs"}
# ``row_linear.c``'s entry point and its bit in ``flexpage_row_linear_formats`` for each dtype
ROW_LINEARS = {torch.float32: ("flexpage_f32_linear", 1), torch.bfloat16: ("flexpage_bf16_linear", 2)}


def row_linear_available(dtype: torch.dtype) -> bool:
    """Whether ``row_linear`` runs here for ``dtype``: its library built, for a CPU whose
    instructions its build covers (AVX2 or AVX-512, for both dtypes)."""
    lib = library("row_linear")
    return dtype in ROW_LINEARS and lib is not None and bool(lib.flexpage_row_linear_formats() & ROW_LINEARS[dtype][1])


def row_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lib: ctypes.CDLL | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for float32 or bfloat16 CPU tensors of one dtype (``weight``
    contiguous), by ``row_linear.c``; only where ``row_linear_available(x.dtype)``. Sums in float32
    (bfloat16: rounded once). ``lib``: another build of it (a benchmark's), not this one's."""
    entry = getattr(lib or library("row_linear"), ROW_LINEARS[x.dtype][0])
    shape = x.shape  # (the fewest tensor ops: a decode step calls this for every linear layer)
    flat = x.view(-1, shape[-1]) if x.is_contiguous() else x.reshape(-1, shape[-1]).contiguous()
    rows, (features, width) = flat.shape[0], weight.shape
    out = flat.new_empty((rows, features))
    status = entry(flat.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), rows, width, features,
                   out.data_ptr())
    if status:
        raise RuntimeError(f"{ROW_LINEARS[x.dtype][0]} failed with status {status}")
    return out if len(shape) == 2 else out.view(*shape[:-1], features)


def cxx_compiler() -> str | None:
    """The C++ compiler the native ops are built with (``$CXX``, else ``c++`` or ``g++`` on the path)."""
    return os.environ.get("CXX") or _path_cxx()


@functools.cache
def _path_cxx() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


# flexpage's native ops: schemas and shapes here, CPU kernels in ``ops.cpp`` (``native_ops``)
_OPS = torch.library.Library("flexpage", "FRAGMENT")
_OPS.define("row_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_OPS.define("paged_decode(Tensor query, Tensor key_pool, Tensor value_pool, Tensor table, Tensor tok_rows, "
            "Tensor tok_pos, int page_size, int window, float scale, float cap) -> Tensor")


@torch.library.register_fake("flexpage::row_linear")
def _row_linear_shape(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("flexpage::paged_decode")
def _paged_decode_shape(query: Tensor, key_pool: Tensor, value_pool: Tensor, table: Tensor, tok_rows: Tensor,
                        tok_pos: Tensor, page_size: int, window: int, scale: float, cap: float) -> Tensor:
    return query.new_empty(query.shape)  # contiguous, as the kernel returns it


_ops_lock = threading.Lock()


@functools.cache
def native_ops() -> bool:
    """Load ``ops.cpp`` (with its own builds of ``row_linear.c`` and ``decode_attention.c``) into
    torch's dispatcher, where it registers the C++ CPU kernels of ``flexpage::row_linear`` and
    ``flexpage::paged_decode``: built once per source, compilers, torch and CPU, like the C
    libraries. False where it cannot be built or loaded (logged): ``row_linear`` then gets
    ``row_linear`` through Python as its kernel, and ``paged_decode`` none (its callers check this
    first). Once per process, under a lock: an op's kernel is registered for good."""
    with _ops_lock:
        if _load_native_ops():
            return True
        _OPS.impl("row_linear", row_linear, "CPU")
        return False


def _load_native_ops() -> bool:
    cc, cxx = compiler(), cxx_compiler()
    torch_dir = Path(torch.__file__).parent
    cxx_flags = ["-O2", "-std=c++20", "-fPIC", f"-I{torch_dir / 'include'}",
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    link_flags = ["-shared", f"-L{torch_dir / 'lib'}", f"-Wl,-rpath,{torch_dir / 'lib'}", "-fopenmp", "-ltorch_cpu",
                  "-lc10"]
    c_sources = [Path(__file__).with_name(f"{name}.c") for name in ENTRY_POINTS]
    cxx_source = Path(__file__).with_name("ops.cpp")

    def build(scratch: Path, built: Path) -> None:
        # the sources compile side by side, then link
        objects = [str(scratch / f"{source.stem}.o") for source in (*c_sources, cxx_source)]
        run_commands(*([cc, *flags(), "-c", "-o", obj, str(source)] for source, obj in zip(c_sources, objects)),
                     [cxx, *cxx_flags, "-c", "-o", objects[-1], str(cxx_source)])
        run_commands([cxx, "-o", str(built), *objects, *link_flags])

    try:
        if cc is None or cxx is None:
            raise FileNotFoundError("no C and C++ compilers on the path (set $CC and $CXX)")
        inputs = [*(source.read_bytes() for source in (*c_sources, cxx_source)), cc.encode(), cxx.encode(),
                  " ".join(flags()).encode(), " ".join(cxx_flags + link_flags).encode(), torch.__version__.encode()]
        torch.ops.load_library(str(_built("ops", inputs, build)))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning("flexpage: the C++ ops could not be built (%s); the few-row kernel's calls go through Python, "
                    "compiled steps' decode attention through the eager kernels", str(detail)[-2000:])
        return False
    return True


def decode_attention(query: Tensor, key_pool: Tensor, value_pool: Tensor, first_run: Tensor, runs: Tensor,
                     scale: float | None = None, cap: float | None = None) -> Tensor | None:
    """The attention of ``R`` decode tokens (``query`` ``[R, Hq, 1, D]``, CPU), each of its own
    sequence, over pools ``[1, Hkv, slots, D]`` of float32 or bfloat16, or quantised ones
    (``[.., D + 2]``, ``quant.quantise``'s layout), read in place; the sequences' keys lie in runs
    of consecutive slots (``masks.run_arrays``: ``first_run`` ``[R + 1]``, ``runs`` ``[2, n]``).
    A bfloat16 query over bfloat16 pages takes AVX512-BF16 products where the CPU has them (its
    probabilities rounded to bfloat16 for the values' products, as SDPA's bfloat16 kernel does).
    ``cap`` soft-caps the scores (``cap * tanh(score / cap)``, Gemma 2's ``mods.softcap``).
    Returns ``[R, Hq, 1, D]`` in the query's dtype, or None where the kernel does not apply (no
    compiler; pools not contiguous, on another device or of another dtype; more than 16 query
    heads per KV head; ``D`` over 256)."""
    rows, heads, _, dim = query.shape
    kv_heads = key_pool.shape[1]
    if (query.device.type != "cpu" or query.shape[2] != 1 or heads % kv_heads or heads // kv_heads > 16
            or value_dim(key_pool) != dim or dim > 256 or key_pool.dtype != value_pool.dtype
            or key_pool.shape != value_pool.shape or key_pool.dtype not in FORMATS
            or not (key_pool.is_contiguous() and value_pool.is_contiguous()) or first_run.numel() != rows + 1):
        return None
    lib = library()
    if lib is None:
        return None
    folded = query.reshape(rows, kv_heads, heads // kv_heads, dim).float().contiguous()
    out = torch.empty_like(folded)
    # enough parts for every thread to take a few (the KV heads alone may be fewer than threads)
    part_keys = max(PART_KEYS, cdiv(int(runs[1].sum()) * kv_heads, 4 * torch.get_num_threads()))
    status = lib.flexpage_decode_attention(
        folded.data_ptr(), key_pool.data_ptr(), value_pool.data_ptr(), rows, kv_heads, key_pool.shape[2], dim,
        heads // kv_heads, first_run.data_ptr(), runs[0].data_ptr(), runs[1].data_ptr(),
        dim ** -0.5 if scale is None else scale, 0.0 if cap is None else cap, part_keys, FORMATS[key_pool.dtype],
        query.dtype == torch.bfloat16, out.data_ptr())
    if status:
        raise RuntimeError(f"flexpage_decode_attention failed with status {status}")
    return out.reshape(rows, heads, 1, dim).to(query.dtype)
