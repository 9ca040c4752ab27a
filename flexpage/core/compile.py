"""Ahead-of-time compiled kernels for flexpage's static-shape functions, saved to disk per shape.

``compile_static(fn)`` returns a callable that keeps one compiled graph per *signature* of its
arguments (tensor shapes, strides, dtypes and devices, the code and captured constants of mod
functions, plain values) and dispatches to it directly. Each graph is compiled with
``torch.compile(...).aot_compile`` and saved next to inductor's cache, so a later process loads
it in milliseconds instead of re-tracing it with dynamo, and a call skips dynamo's guard
evaluation (a large share of a short decode attention call).
The signature holds everything dynamo would guard on for these functions; tensors captured by
mods are read afresh at each call, exactly as the traced code reads them. One difference from
dynamo: a Python number a mod reads from a *global* (not its closure) is baked into the graph
unguarded, so mods keep their settings in closures, as every mod in ``masks`` does.

Where ``aot_compile`` is missing (older torch) or fails, the function runs under ordinary
``torch.compile`` (one graph per shape, dynamo's guards), with a raised recompile limit, or under
the ``fallback`` the caller gives.

A function whose arguments include objects a signature can't describe (a model, a cache, a
step's mask) is called through ``StaticCompiled.keyed(key, ...)``: the caller names, in ``key``,
everything the graph may specialise on (shapes, buckets, the model's architecture), and the
graph reads the arguments' tensors afresh at each call, as dynamo's generated code does (the
Engine's compiled decode forward: ``model_runner``). Saved graphs keep no guards: flexpage never
evaluates them, the signature or key stands in for them.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import threading
import types
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

import torch
from torch.nn.attention.flex_attention import BlockMask

from . import cpu

F = TypeVar("F", bound=Callable)
log = logging.getLogger(__name__)

# Each (batch, q_len, heads, pool, page size, mods) combination is its own static graph of one
# code object: the Engine's region buckets alone reach 9 per attention variant off CPU, and a
# process may serve several models and pools. Dynamo's default (8 graphs per code object) is too
# few. Since torch 2.12 dynamo's config is per thread: an assignment at import reaches only the
# importing thread, and an Engine built or stepped on another failed on its 9th shape. So the
# limit goes on each compiled function where ``torch.compile`` takes one (on the config before).
RECOMPILE_LIMIT = 256
_PER_FUNCTION = "recompile_limit" in inspect.signature(torch.compile).parameters
if not _PER_FUNCTION:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)

AOT_ENV = "FLEXPAGE_AOT"  # "0": ordinary torch.compile (dynamo guards, no files)


class Unsupported(TypeError):
    """An argument whose identity a signature can't capture: the call goes through dynamo."""


def _tensor_signature(tensor: torch.Tensor) -> tuple:
    return ("T", tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.requires_grad)


def signature(value: Any) -> Any:
    """A hashable description of ``value`` as a compiled graph specialises on it."""
    if isinstance(value, torch.Tensor):
        return _tensor_signature(value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(value), value)  # bool apart from int: True == 1
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(signature(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, signature(v)) for k, v in value.items()))
    if isinstance(value, types.FunctionType):
        cells = tuple(signature(c.cell_contents) for c in value.__closure__ or ())
        return ("F", value.__code__, cells, signature(value.__defaults__), signature(value.__kwdefaults__))
    if isinstance(value, functools.partial):
        return ("P", signature(value.func), signature(value.args), signature(value.keywords))
    if type(value) is BlockMask:
        return (BlockMask, signature(vars(value)))  # its tensors, sizes and mask_mod
    raise Unsupported(f"no signature for {type(value).__name__}")


def _global_state() -> tuple[bool, bool, bool]:
    """The process state a graph specialises on besides its arguments (dynamo guards these too)."""
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch._C._is_any_autocast_enabled()


def _portable(sig: Any) -> str:
    """``sig`` as text that is the same in every process (code objects by name and bytecode)."""
    if isinstance(sig, tuple):
        return "(" + ",".join(_portable(s) for s in sig) + ")"
    if isinstance(sig, types.CodeType):
        body = hashlib.sha256(sig.co_code + repr(sig.co_consts).encode() + repr(sig.co_names).encode()).hexdigest()
        return f"{sig.co_qualname}@{Path(sig.co_filename).name}:{body[:16]}"
    if isinstance(sig, type):
        return f"{sig.__module__}.{sig.__qualname__}"
    return repr(sig)


@functools.cache
def _code_version() -> str:
    """torch's and transformers' versions, a hash of flexpage's sources and the CPU acted on
    (``cpu.signature``: a graph's kernels are compiled for its instruction sets): a saved graph from
    other code or another tier is not used (a compiled model forward holds transformers' modelling code)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        transformers = version("transformers")
    except PackageNotFoundError:
        transformers = "-"
    digest = hashlib.sha256(f"{torch.__version__}|{transformers}|{cpu.signature()}".encode())
    for path in sorted(Path(__file__).parents[1].rglob("*.py")):  # the whole flexpage package, not only core/
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def artifact_dir() -> Path:
    """Where flexpage keeps what it measured or compiled ahead of time: inductor's cache folder."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "flexpage"


def _no_guards(entries: list) -> list[bool]:
    """Keep no guard with a saved graph (the signature or key stands in for them): some can't be
    serialised at all (a transformers model's locally defined classes), and none is evaluated."""
    return [False] * len(entries)


def _load(path: Path) -> Callable:
    import torch._guards as guards
    from torch._inductor import config as inductor_config

    # Loading a CPU graph makes inductor check every vector ISA the CPU's flags list by building
    # and loading a probe library in a fresh Python process each (10 processes on AVX-512 cores).
    # A saved graph was built and loaded with this cache's ISA by an earlier process, so the flags
    # are trusted for the base ISAs while loading one (4 of those 10 processes; a warm Engine's
    # build 3.5-3.9 -> 1.9-2.5 s), unless the user set ``cpp.vec_isa_ok`` either way.
    trust_isa = {"cpp.vec_isa_ok": True} if inductor_config.cpp.vec_isa_ok is None else {}
    # Rebuilding the saved guards needs a tracing context (torch 2.13); we never evaluate them.
    with open(path, "rb") as f, guards.tracing(guards.TracingContext(None)), inductor_config.patch(trust_isa):
        compiled = torch.compiler.load_compiled_function(f)
    compiled.disable_guard_check()
    return compiled


class StaticCompiled(Generic[F]):
    """``fn`` compiled once per argument signature, ahead of time, loaded from disk when saved.

    ``graphs`` counts the signatures this process has compiled or loaded (the number of graphs
    it holds); ``loaded`` those that came from disk.
    """

    def __init__(self, fn: F, fallback: Callable | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        limit = {"recompile_limit": RECOMPILE_LIMIT} if _PER_FUNCTION else {}
        # calls that can't be compiled ahead of time: ``fallback``, else dynamo with its guards
        self.dynamo = fallback or torch.compile(fn, dynamic=False, fullgraph=True, **limit)
        # no size asserts in the graph's wrapper (one per input and per custom op's output, ~0.5 us each:
        # a decode step's graph had 164): a graph is only called with what its signature or key names
        self._aot_compiler = torch.compile(fn, dynamic=False, fullgraph=True,
                                           options={"guard_filter_fn": _no_guards, "size_asserts": False})
        self.aot = (hasattr(self._aot_compiler, "aot_compile")
                    and hasattr(torch.compiler, "load_compiled_function"))
        self._graphs: dict[Any, Callable] = {}
        self._lock = threading.Lock()
        self._memo: dict[int, tuple[Any, int]] = {}  # id -> (object, its interned signature)
        self._interned: dict[Any, int] = {}
        self.graphs = self.loaded = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inside a bigger compiled region: trace through
            return self.fn(*args, **kwargs)
        if not self.aot or os.environ.get(AOT_ENV) == "0":
            return self.dynamo(*args, **kwargs)
        try:
            key = (*map(self._signature, args), *[(k, self._signature(v)) for k, v in kwargs.items()],
                   *_global_state())
        except Unsupported:
            return self.dynamo(*args, **kwargs)
        graph = self._graphs.get(key)
        if graph is None:
            with self._lock:
                graph = self._graphs.get(key) or self._compile(args, kwargs)
                self._graphs[key] = graph
        return graph(*args, **kwargs)

    def keyed(self, key: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` through the graph for ``key``, compiled or loaded on first use.

        For arguments a signature can't describe (``Unsupported``): ``key`` must hold everything
        the traced code specialises on, as plain values and tuples of them whose ``repr`` is the
        same in every process (it names the saved graph). The graph reads the arguments' tensors,
        and the attributes of objects among them, at each call; a Python value it read while
        tracing and that ``key`` leaves out is baked in. Grad modes are added to the key."""
        if torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
        if not self.aot or os.environ.get(AOT_ENV) == "0":
            return self.dynamo(*args, **kwargs)
        full = ("K", key, *_global_state())
        graph = self._graphs.get(full)
        if graph is None:
            with self._lock:
                graph = self._graphs.get(full) or self._compile(args, kwargs, _portable(full))
                self._graphs[full] = graph
        return graph(*args, **kwargs)

    def _signature(self, value: Any) -> Any:
        """``signature(value)``, fast for what repeats: a step passes the same mask and mods to
        every layer, so their (deep) signatures are memoised by identity, as small integers
        (masks and mods are never changed once built)."""
        if type(value) is torch.Tensor:
            return _tensor_signature(value)
        if not isinstance(value, (types.FunctionType, BlockMask)):
            return signature(value)
        memo = self._memo.get(id(value))
        if memo is None or memo[0] is not value:
            if len(self._memo) > 64:
                self._memo.clear()
            sig = signature(value)
            memo = self._memo[id(value)] = (value, self._interned.setdefault(sig, len(self._interned)))
        return memo[1]

    def _compile(self, args: tuple, kwargs: dict, described: str | None = None) -> Callable:
        """The graph for these arguments, loaded from disk or compiled (and saved); ``described``
        is their portable description (``keyed``), else it comes from their signature."""
        name = f"{self.fn.__module__}.{self.fn.__qualname__}"
        if described is None:
            described = _portable((signature(args), signature(kwargs), *_global_state()))
        digest = hashlib.sha256(f"{_code_version()}|{name}|{described}".encode()).hexdigest()[:24]
        path = artifact_dir() / f"{self.fn.__qualname__}-{digest}.bin"
        self.graphs += 1
        if path.exists():
            try:
                graph = _load(path)
                self.loaded += 1
                return graph
            except Exception as error:  # stale or unreadable: compile it again
                log.warning("flexpage: recompiling %s (%s: %s)", path.name, type(error).__name__, error)
        try:
            compiled = self._aot_compiler.aot_compile((args, kwargs))
        except Exception as error:
            log.warning("flexpage: %s compiles through dynamo (aot_compile failed: %s: %s)",
                        name, type(error).__name__, error)
            return self.dynamo
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(path))
        except Exception as error:  # an unwritable cache costs later processes a compile, nothing else
            log.warning("flexpage: could not save %s (%s: %s)", path.name, type(error).__name__, error)
        compiled.disable_guard_check()
        return compiled


_REGISTRY: list[StaticCompiled] = []


def compile_static(fn: F, fallback: Callable | None = None) -> StaticCompiled[F]:
    """``fn`` compiled whole with static shapes, one graph per argument signature or caller's key
    (see module doc); ``fallback`` runs calls that can't be compiled ahead of time."""
    compiled = StaticCompiled(fn, fallback)
    _REGISTRY.append(compiled)
    return compiled


def graph_counts() -> dict[str, int]:
    """Graphs flexpage's static functions hold in this process: ``held`` (compiled or loaded)
    and ``loaded`` (those read from disk, saved by an earlier process)."""
    return {"held": sum(c.graphs for c in _REGISTRY), "loaded": sum(c.loaded for c in _REGISTRY)}
