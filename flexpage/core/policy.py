"""One device policy: which kernel attends what, and how step metadata reaches the device.

Every choice that differs between the CPU and an accelerator is a field here, decided once per
device kind (``device_policy``) and read where the choice is made, so the two layouts can be
read side by side. The reasons, and the measurements behind them, are in the docs' design page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DevicePolicy:
    """The kernel and layout choices for one kind of device."""

    # A lone sequence's decode token, or one prefill chunk, is attended by SDPA over its pages
    # (eager calls of layers without a score mod): no compiled call, no padding to a block.
    sdpa_lone_sequence: bool
    # A chunk after earlier keys is two unmasked flash calls merged by log-sum-exp (a CPU op).
    split_chunk_attention: bool
    # One-token rows of grouped-query layers carry each KV head's query heads along the query
    # axis (eager), so the attention template reads each KV block once per KV head.
    grouped_decode_rows: bool
    # BlockMask ``kv_indices`` cover the whole pool (inductor's CPU template asserts it) rather
    # than a sequence's page budget.
    pool_wide_metadata: bool
    # Batches of one-token rows list equal block counts (inductor's CPU decoding template).
    uniform_decode_rows: bool
    # FlexAttention tiles are set to divide the mask's blocks, and multi-token rows kept off the
    # decode kernel (CUDA's templates).
    tile_options: bool
    # Host ints reach the device by wrapping their buffer (the CPU: no copy) instead of one copy.
    zero_copy_host_ints: bool
    # Sampling reads rows on the host (NumPy argmax, blocked CDFs, a row at a time); elsewhere
    # whole-batch kernels.
    host_sampling: bool
    # Decode tokens over pages of these dtypes are attended by flexpage's C kernel reading each
    # row's pages in place (``kernels``), a batch of them in one call: faster than FlexAttention's
    # CPU template, and quantised pages need no dequantised copy. Called from C++ where those ops
    # build (``flexpage::paged_decode``: faster than SDPA's flash kernel from the fewest keys).
    decode_kernel_dtypes: frozenset[torch.dtype]
    # ... where the C++ ops do not build (the kernel through ``ctypes``), a lone decode token over
    # float pages from this many keys on (SDPA's flash kernel is faster below); over quantised pages always.
    lone_decode_kernel_keys: int
    # Tokens per page when ``wrap`` chooses: larger pages mean fewer, larger KV blocks.
    page_size: int
    # Decode-only steps run the whole forward compiled by default, every bucket (where it measured
    # faster than eager: the compiled step calls the eager path's attention and packed linears).
    compile_decode: bool = False
    # Compiled static steps are recorded once per bucket as CUDA graphs and replayed (CUDA devices:
    # ``step_graph``), their launches no longer paid from Python at every step.
    capture_steps: bool = False


CPU_POLICY = DevicePolicy(sdpa_lone_sequence=True, split_chunk_attention=True, grouped_decode_rows=True,
                          pool_wide_metadata=True, uniform_decode_rows=True, tile_options=False,
                          zero_copy_host_ints=True, host_sampling=True,
                          decode_kernel_dtypes=frozenset({torch.int8, torch.float8_e4m3fn, torch.float32, torch.bfloat16}),
                          lone_decode_kernel_keys=1024,
                          page_size=64, compile_decode=True)
ACCELERATOR_POLICY = DevicePolicy(sdpa_lone_sequence=False, split_chunk_attention=False, grouped_decode_rows=False,
                                  pool_wide_metadata=False, uniform_decode_rows=False, tile_options=True,
                                  zero_copy_host_ints=False, host_sampling=False,
                                  decode_kernel_dtypes=frozenset(), lone_decode_kernel_keys=0,
                                  page_size=16, capture_steps=True)


def device_policy(device: torch.device) -> DevicePolicy:
    """The policy for tensors on ``device``."""
    return CPU_POLICY if device.type == "cpu" else ACCELERATOR_POLICY


def records_steps(device: torch.device) -> bool:
    """Whether static steps on ``device`` are recorded as CUDA graphs: its policy's ``capture_steps``,
    on a CUDA device (the graphs are CUDA's)."""
    return device_policy(device).capture_steps and device.type == "cuda"
