"""Recorded static steps: a decode bucket's compiled step captured once as a CUDA graph, then
replayed, so that a decode step costs one graph launch instead of a forward's hundreds of kernel
launches from Python (as nano-vllm's model runner and vLLM's FlexAttention backend do).

A static step (``static_step.StaticSteps``) reads only tensors that every step rewrites in place
(``StaticDecode``: token ids, positions, slots, rows, the mask's block metadata) and keeps nothing
it allocates, which is what a graph needs: its kernels, their arguments and the buffers' addresses
are recorded once and replayed over whatever those tensors hold at the time. The buckets of one
``StaticSteps`` record into one memory pool; the Engine's warm-up records them largest first, so the
smaller ones reuse the largest's memory.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor

from .policy import records_steps

Step = Callable[[], Tensor]  # one static step over its bucket's tensors: the logits it computes


class Recorder(Protocol):
    """Records steps to be replayed: ``record(step)`` returns what replays it (returning the
    logits, in a tensor valid until that bucket's next step)."""

    def record(self, step: Step) -> Step: ...


class CudaGraphs:
    """Records steps as CUDA graphs sharing one memory pool (``torch.cuda.graph_pool_handle``)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def record(self, step: Step) -> Step:
        """``step`` run once on a side stream (lazy initialisation, autotuning and the allocator's
        growth happen outside the graph), then captured; the returned function replays it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()

        def replay() -> Tensor:
            graph.replay()
            return logits

        return replay


def step_recorder(device: torch.device) -> Recorder | None:
    """What records the static steps of a model on ``device``: CUDA graphs where its policy records
    steps (``policy.records_steps``), else None (the steps run as they are)."""
    return CudaGraphs() if records_steps(device) else None
