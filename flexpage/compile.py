"""``torch.compile`` for flexpage's static-shape kernels: one graph per shape, and many shapes."""

from __future__ import annotations

import inspect
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

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


def compile_static(fn: F) -> F:
    """``fn`` compiled whole with static shapes, allowed ``RECOMPILE_LIMIT`` graphs on any thread.
    A cache hit moves its graph to the front of dynamo's list, so hot graphs stay cheap to find."""
    limit = {"recompile_limit": RECOMPILE_LIMIT} if _PER_FUNCTION else {}
    return torch.compile(fn, dynamic=False, fullgraph=True, **limit)
