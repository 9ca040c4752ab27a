"""Linear layers fed a few rows (a decode step's tokens), in whichever orientation the CPU's BLAS
is faster at for them.

In a decode step every linear layer multiplies a handful of rows (one per sequence) by its
weight. MKL (float32) computes ``x @ W.T`` and the same product taken as ``(W @ x.T).T`` at very
different speeds, and which one wins depends on the CPU: on the AMD EPYC cores this project was
first measured on, the transposed form was 1.3-3x faster over 2-16 rows (2 rows through a
1536x512 weight: 0.44 -> 0.20 ms; through the 32000x512 LM head: 12.5 -> 3.8 ms); on an Intel
Xeon (AVX-512) it is 2-5x *slower* over 1-8 rows (LM head, 2 rows: 1.4 -> 4.1 ms) and faster
again at 16-32 (10.0 -> 5.0 ms). So ``few_row_linear`` times both orientations, alternated,
on the first calls that meet a weight shape with a given number of rows (rounded up to a power
of two), and uses the faster one from then on in this process. The timed calls are the model's
own, so each weight is as cold in cache as a forward leaves it: timing one weight in a loop keeps
it hot, and on the AMD cores that picked the plain product for most layers at one row (24.3 ms
per decoded token for ``llama-small``, against 18.1 ms with the choices timed in the forward).
Results differ from ``F.linear``'s in the last bits where the transposed form wins, as paged
attention's already do from SDPA's.
``FewRowLinears`` routes a model's ``nn.Linear`` layers through it for forwards through a paged
cache only (a flag set by a hook on the model), so a wrapped model's plain forward (scoring,
training) stays bit-for-bit the stock one.
"""

from __future__ import annotations

import time
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 256  # above this the products cost the same both ways and the transposing copy is pure cost
TRIALS = 4  # calls timed in each orientation, alternated, before a (weight shape, row bucket) is decided

Key = tuple[int, int, bool, int]  # (out_features, in_features, has bias, row bucket)
faster_transposed: dict[Key, bool] = {}  # decided keys -> whether the transposed form was faster
trials: dict[Key, tuple[list[float], list[float]]] = {}  # keys on trial -> seconds of (plain, transposed) calls


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ rows.T).T``. A single row goes in as
    two copies of itself: MKL's two-column GEMM reads a weight faster than its matrix-vector
    product on some CPUs (AMD EPYC, 32000x512 LM head: 6.3 -> 5.0 ms)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = flat.repeat(2, 1)
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias[:, None], weight, flat.t())
    return out[:, :rows].t().contiguous().view(*x.shape[:-1], weight.shape[0])


def row_key(rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> Key:
    """The key under which a product of ``rows`` rows through ``weight`` is decided."""
    return weight.shape[0], weight.shape[1], bias is not None, 1 << (rows - 1).bit_length()


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU inputs of 1..``MAX_ROWS`` rows in the
    orientation measured faster for this weight shape and row bucket (timing this very call while
    that is undecided); otherwise ``F.linear``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_ROWS or x.device.type != "cpu" or not x.dtype == weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    key = row_key(rows, weight, bias)
    transposed = faster_transposed.get(key)
    if transposed is None:
        if torch.compiler.is_compiling():  # nothing to time while tracing: inductor's own GEMM
            return F.linear(x, weight, bias)
        return _timed(key, x, weight, bias)
    return transposed_linear(x, weight, bias) if transposed else F.linear(x, weight, bias)


def _timed(key: Key, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product in the orientation ``key`` has timed fewer calls of, timed; once each has
    ``TRIALS`` calls the one with the fastest call is decided for ``key``."""
    plain, transposed = trials.setdefault(key, ([], []))
    use_transposed = len(transposed) < len(plain)
    start = time.perf_counter()
    out = transposed_linear(x, weight, bias) if use_transposed else F.linear(x, weight, bias)
    (transposed if use_transposed else plain).append(time.perf_counter() - start)
    if len(transposed) == TRIALS:
        faster_transposed[key] = min(transposed) < min(plain)
        del trials[key]
    return out


class FewRowLinears:
    """Route ``model``'s plain ``nn.Linear`` layers through ``few_row_linear`` during the
    forwards ``is_paged(kwargs)`` accepts. Layers off the CPU, layers whose ``forward`` is
    already replaced on the instance (accelerate's offload hooks) and tensor-parallel (DTensor)
    weights are left alone. A compiled forward takes the orientation measured beforehand
    (``measure``), else inductor's own GEMM."""

    def __init__(self, model: nn.Module, is_paged: Callable[[dict], bool]) -> None:
        self.active = False
        self._is_paged = is_paged
        self.layers = [
            module for module in model.modules()
            if type(module) is nn.Linear and "forward" not in vars(module) and type(module.weight) is nn.Parameter
            and module.weight.device.type == "cpu"  # elsewhere the layer keeps its own forward (no per-call cost)
        ]
        for layer in self.layers:
            layer.forward = types.MethodType(self._forward, layer)
        self._hooks = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def measure(self, max_rows: int) -> None:
        """Decide now every weight shape's orientation at each row bucket up to ``max_rows``, for a
        forward that cannot time its own calls (``wrap(compile_decode=True)``: its decode forward
        is traced, not run): random rows go through the layers in model order, as in a forward
        (each weight as cold in cache), sweep after sweep until every such key is decided."""
        layers = [layer for layer in self.layers if layer.weight.dtype == torch.float32]
        with torch.no_grad():
            for bucket in range((min(max_rows, MAX_ROWS) - 1).bit_length() + 1):
                for _ in range(2 * TRIALS):  # a weight shape met once per sweep is decided after the last
                    for layer in layers:
                        if row_key(1 << bucket, layer.weight, layer.bias) not in faster_transposed:
                            few_row_linear(torch.randn(1 << bucket, layer.in_features), layer.weight, layer.bias)

    def remove(self) -> None:
        """Give every layer back its class's ``forward`` and drop the hooks."""
        for layer in self.layers:
            del layer.forward
        for hook in self._hooks:
            hook.remove()
        self.layers, self.active = [], False

    def _forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.active:
            return few_row_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.active = self._is_paged(kwargs)

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.active = False
