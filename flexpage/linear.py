"""Linear layers fed a few rows (a decode step's tokens), computed the way CPU BLAS is fast at.

In a decode step every linear layer multiplies a handful of rows (one per sequence) by its
weight. On the x86 CPUs this project runs on (MKL, float32) ``x @ W.T`` over 2-16 rows costs
1.3-3x the same product taken as ``(W @ x.T).T``: MKL handles a GEMM with few columns well and
one with few rows badly (measured per weight shape of ``llama-small``: 2 rows 0.44 -> 0.20 ms
for 1536x512, 12.5 -> 3.8 ms for the 32000x512 LM head; bit-identical from ~32 rows on, where
both reach the same kernel; a decode step of 8 sequences at 1024 tokens: 65-74 -> 49 ms).
Below 32 rows the results differ from ``F.linear``'s in the last bits, as paged attention's
already do from SDPA's. ``FewRowLinears`` switches a model's ``nn.Linear`` layers to that
orientation for forwards through a paged cache only (a flag set by a hook on the model), so a
wrapped model's plain forward (scoring, training) stays bit-for-bit the stock one.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 256  # above this the products cost the same both ways and the transposing copy is pure cost


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed as ``(weight @ rows.T).T`` when ``x`` holds
    2..``MAX_ROWS`` float32 rows on the CPU (the faster orientation there), else by ``F.linear``.
    A single row meets a tall weight (``out >= 2 * in``: the LM head, gate/up projections) as
    two copies of itself: MKL's two-column GEMM reads the weight faster than its
    matrix-vector product does (32000x512 LM head: 6.3 -> 5.0 ms, cold caches)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    fewest = 1 if weight.shape[0] >= 2 * weight.shape[1] else 2  # a tall weight gains from one row on
    if not fewest <= rows <= MAX_ROWS or x.device.type != "cpu" or not x.dtype == weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = flat.repeat(2, 1)
    out = torch.mm(weight, flat.t()) if bias is None else torch.addmm(bias[:, None], weight, flat.t())
    return out[:, :rows].t().contiguous().view(*x.shape[:-1], weight.shape[0])


class FewRowLinears:
    """Route ``model``'s plain ``nn.Linear`` layers through ``few_row_linear`` during the
    forwards ``is_paged(kwargs)`` accepts. Layers off the CPU, layers whose ``forward`` is
    already replaced on the instance (accelerate's offload hooks) and tensor-parallel (DTensor)
    weights are left alone; so are compiled forwards (inductor chooses its own GEMMs)."""

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

    def remove(self) -> None:
        """Give every layer back its class's ``forward`` and drop the hooks."""
        for layer in self.layers:
            del layer.forward
        for hook in self._hooks:
            hook.remove()
        self.layers, self.active = [], False

    def _forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and self.active:
            return few_row_linear(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.active = self._is_paged(kwargs)

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.active = False
