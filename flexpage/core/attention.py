"""One compiled FlexAttention call over a layer's page pools."""

from __future__ import annotations

import itertools
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .compile import compile_static
from .masks import PackedBlockMask, ScoreMod, SequenceKV, StaticDecodeMask, static_mask_at
from .host import cdiv
from .kernels import decode_attention, native_ops
from .policy import device_policy
from .quant import dequantise_into, dequantised_pool, is_quantised, scratch_pool, value_dim


def _flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options):
    return flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, kernel_options=kernel_options)


def kernel_options(query: Tensor, block_size: tuple[int, int]) -> dict | None:
    """FlexAttention kernel options for ``query`` over a mask of ``block_size`` (query, KV) blocks.

    On GPUs, queries of more than one token per row stay on the FlexAttention kernel (below 128
    tokens PyTorch would route them to its decode kernel, which our chunk masks don't fit), and
    its tiles must divide the mask's blocks: its default tiles reach 128 queries x 128 keys, so a
    query block under 128 tokens sets the query tile and a page under 128 tokens the key tile
    (at most 64). One-token rows (decode) take the decode kernel, which fits its tiles itself.
    """
    if not device_policy(query.device).tile_options or query.shape[2] == 1:
        return None
    q_block, kv_block = block_size
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_N": min(kv_block, 64)}
    if q_block < 128:
        options["BLOCK_M"] = q_block
    return options


# One compile per static shape (batch, heads, q_len, pool): the pool never changes shape, so
# decode at any context length reuses the same graph; page tables arrive as tensor data.
# Compiling our own function (not ``flex_attention`` itself) keeps dynamo's per-code-object
# state apart from other compiled callers of flex_attention in the process (transformers'
# "flex_attention" implementation): otherwise their shape changes turn on dynamic shapes
# for both, which inductor's CPU template fails to compile.
_compiled_flex_attention = compile_static(_flex_attention)


def paged_attention(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_mask: BlockMask,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
) -> Tensor:
    """Attention of ``query`` ``[B, Hq, Q, D]`` over pools ``[1, Hkv, slots, D]``.

    ``block_mask`` comes from ``masks.build_block_mask`` and ``score_mod`` (if any) from
    ``masks.paged_score_mod``. GQA/MQA is used when ``Hq`` is a multiple of ``Hkv``.
    Returns ``[B, Hq, Q, Dv]``.
    """
    if query.dim() != 4 or key_pool.dim() != 4 or value_pool.dim() != 4:
        raise ValueError(
            f"query and pools must be 4-D, got query {tuple(query.shape)}, key_pool {tuple(key_pool.shape)}, "
            f"value_pool {tuple(value_pool.shape)}"
        )
    if is_quantised(key_pool):
        raise ValueError("paged_attention reads pools of the query's dtype; quantised pools are attended by "
                         "packed_attention (or dequantised first: flexpage.core.quant.dequantise)")
    num_heads, num_kv_heads = query.shape[1], key_pool.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key_pool heads ({num_kv_heads})")
    if key_pool.shape[:3] != value_pool.shape[:3] or key_pool.shape[0] != 1:
        raise ValueError(
            f"key_pool and value_pool must be [1, kv_heads, slots, dim] pools of one cache layer, "
            f"got {tuple(key_pool.shape)} and {tuple(value_pool.shape)}"
        )
    if query.shape[-1] != key_pool.shape[-1]:
        raise ValueError(f"query head_dim ({query.shape[-1]}) differs from key_pool's ({key_pool.shape[-1]})")
    if query.dtype != key_pool.dtype or value_pool.dtype != key_pool.dtype:
        raise ValueError(
            f"query dtype {query.dtype} must match the pools' dtype {key_pool.dtype} (value {value_pool.dtype})"
        )
    if query.device != key_pool.device or value_pool.device != key_pool.device:
        raise ValueError(f"query on {query.device} but pools on {key_pool.device}/{value_pool.device}")
    if block_mask.kv_num_blocks.shape[0] != query.shape[0]:
        raise ValueError(
            f"block_mask is for batch {block_mask.kv_num_blocks.shape[0]} but query has batch {query.shape[0]}"
        )
    return _compiled_flex_attention(query, key_pool, value_pool, score_mod, block_mask, scale, num_heads != num_kv_heads,
                                    kernel_options(query, block_mask.BLOCK_SIZE))


def query_group(query: Tensor, key_pool: Tensor) -> int:
    """Query heads per KV head to lay along the query axis of one-token rows (``rows_attention``):
    ``head_group``'s, eagerly; 1 while a forward is traced, which must find its masks built
    (a static step's mask fixes its own group, ``PackedBlockMask.group``)."""
    return 1 if torch.compiler.is_compiling() else head_group(query.device, query.shape[1], key_pool.shape[1])


def head_group(device: torch.device, heads: int, kv_heads: int) -> int:
    """Query heads per KV head to lay along the query axis of one-token rows: on CPU, with
    grouped-query attention, inductor's FlexAttention template then reads each KV block once per
    KV head instead of once per query head. Elsewhere 1: the GPU decode kernel groups heads itself."""
    if not device_policy(device).grouped_decode_rows or heads == kv_heads or heads % kv_heads:
        return 1
    return heads // kv_heads


def rows_attention(query: Tensor, key_pool: Tensor, value_pool: Tensor, block_mask: BlockMask,
                   score_mod: ScoreMod | None, scale: float | None, group: int) -> Tensor:
    """``paged_attention`` of one-token rows ``[B, Hq, 1, D]``, with ``group`` query heads per
    KV head along the query axis (``[B, Hq / group, group, D]``; ``group == 1`` is the plain
    layout); the mask and mod must be built for that ``group`` (``masks.grouped_mask_mod``).
    Returns ``[B, Hq, 1, Dv]``."""
    batch, heads, _, dim = query.shape
    grouped = query.reshape(batch, heads // group, group, dim)
    out = paged_attention(grouped, key_pool, value_pool, block_mask, score_mod, scale)
    return out.reshape(batch, heads, 1, out.shape[-1])


def sequence_attention(query: Tensor, key_pool: Tensor, value_pool: Tensor, kv: SequenceKV,
                       scale: float | None = None) -> Tensor:
    """One sequence's attention by SDPA over its keys in the pools: a decode token
    (``query`` ``[1, Hq, 1, D]``) or a prefill chunk (``[1, Hq, n, D]``: causal after
    ``kv.earlier`` keys, or masked by ``kv.allowed`` under a sliding window).

    ``kv`` (``decode_kv`` / ``chunk_kv`` of the step's mask) names the keys' slots. Keys in
    consecutive slots are attended in place (a slice of the pool, no copy), others are
    gathered first. A decode token over quantised pages, or over many keys (the policy's
    ``decode_kernel_dtypes`` and ``lone_decode_kernel_keys``), is attended by the C kernel reading
    the pages in place (``kernels.decode_attention``); quantised keys are otherwise dequantised into
    a scratch pool (``quant.scratch_pool``). See
    ``sdpa_over_pages`` for when this is the kernel.
    """
    policy = device_policy(query.device)
    if (query.shape[2] == 1 and key_pool.dtype in policy.decode_kernel_dtypes
            and (is_quantised(key_pool) or kv.width >= policy.lone_decode_kernel_keys)):
        out = decode_attention(query, key_pool, value_pool, *kv.kernel_runs, scale)  # the values in place
        if out is not None:
            return out
    if kv.runs and not is_quantised(key_pool):
        return _runs_attention(query, key_pool, value_pool, kv.runs, kv.width, scale)
    if kv.runs:  # quantised runs: dequantised one after another into the scratch pools
        keys = scratch_pool(key_pool, query.dtype, "keys")[:, :, : kv.width]
        values = scratch_pool(value_pool, query.dtype, "values")[:, :, : kv.width]
        for (start, count), at in zip(kv.runs, itertools.accumulate((count for _, count in kv.runs), initial=0)):
            dequantise_into(key_pool[:, :, start : start + count], keys[:, :, at : at + count])
            dequantise_into(value_pool[:, :, start : start + count], values[:, :, at : at + count])
    elif kv.start is not None:
        keys = key_pool[:, :, kv.start : kv.start + kv.width]
        values = value_pool[:, :, kv.start : kv.start + kv.width]
    else:
        keys, values = key_pool[:, :, kv.slots], value_pool[:, :, kv.slots]
    if is_quantised(keys):  # quantised pages: dequantised into the first slots of the scratch pools
        keys = dequantise_into(keys, scratch_pool(key_pool, query.dtype, "keys")[:, :, : kv.width])
        values = dequantise_into(values, scratch_pool(value_pool, query.dtype, "values")[:, :, : kv.width])
    batch, heads, n, _ = query.shape
    if kv.earlier and policy.split_chunk_attention:  # the keys as one run
        return _runs_attention(query, keys, values, ((0, kv.width),), kv.width, scale)
    if n == 1 and heads != keys.shape[1]:  # a decode token sees every key
        out = F.scaled_dot_product_attention(_heads_folded(query, keys.shape[1]), keys, values, scale=scale)
        return out.reshape(batch, heads, 1, out.shape[-1])
    allowed, causal = kv.allowed, kv.causal
    if kv.earlier:  # off CPU: one masked call
        allowed, causal = causal_after(n, kv.earlier, query.device), False
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, is_causal=causal, scale=scale,
                                          enable_gqa=heads != keys.shape[1])


def _runs_attention(query: Tensor, key_pool: Tensor, value_pool: Tensor, runs: tuple[tuple[int, int], ...],
                    width: int, scale: float | None) -> Tensor:
    """One sequence's queries (``[1, Hq, n, D]``: a decode token, or a chunk whose ``n`` tokens are
    the last of the ``width`` keys, causal after the others) over keys lying in ``runs`` of
    consecutive slots of the pools, nothing gathered: the keys every query sees one flash call per
    run (heads folded, so each KV head is read once), the chunk's own keys causally, merged by
    log-sum-exps. One masked call over all the keys would spend the masked half of the chunk's own
    square and read a mask. CPU only (the CPU kernel)."""
    batch, heads, n, _ = query.shape
    kv_heads = key_pool.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    seen = width - n if n > 1 else width  # keys every query sees whole
    out = lse = None
    folded = _heads_folded(query, kv_heads)
    for start, count in _run_slices(runs, 0, seen):
        part, part_lse = flash(folded, key_pool[:, :, start : start + count], value_pool[:, :, start : start + count],
                               scale=scale)
        out, lse = (part, part_lse) if out is None else _merged(out, lse, part, part_lse)
    if n == 1:
        return out.reshape(batch, heads, 1, out.shape[-1])
    own = list(_run_slices(runs, seen, width))  # the chunk's own keys, causal
    own_keys, own_values = (pool[:, :, own[0][0] : own[0][0] + own[0][1]] if len(own) == 1 else
                            torch.cat([pool[:, :, start : start + count] for start, count in own], dim=2)
                            for pool in (key_pool, value_pool))
    if heads != kv_heads:
        own_keys, own_values = (t.repeat_interleave(heads // kv_heads, 1) for t in (own_keys, own_values))
    mine, mine_lse = flash(query, own_keys, own_values, is_causal=True, scale=scale)
    if out is None:
        return mine
    return _merged(mine, mine_lse, out.reshape(batch, heads, n, -1), lse.reshape(batch, heads, n))[0]


def _run_slices(runs: tuple[tuple[int, int], ...], lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """``(first slot, keys)`` of the parts of ``runs`` that hold keys ``lo`` to ``hi`` (in key order)."""
    at = 0
    for start, count in runs:
        first, last = max(lo, at), min(hi, at + count)
        if first < last:
            yield start + first - at, last - first
        at += count


def _merged(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over two sets of keys from each one's output and log-sum-exp (``[B, H, n]``): each
    output weighed by its share of the exponentials; and the log-sum-exp over both."""
    weight = torch.sigmoid(part_lse - lse)[..., None].to(out.dtype)
    return torch.lerp(out, part, weight), torch.logaddexp(lse, part_lse)


def _heads_folded(query: Tensor, kv_heads: int) -> Tensor:
    """``query`` ``[B, Hq, n, D]`` as ``[B, kv_heads, group * n, D]``: each KV head's query heads
    along the query axis. Exact where every query sees every key, and the kernel then reads each
    KV head once, not once per query head (4x less at 8 query heads over 2)."""
    batch, heads, n, dim = query.shape
    return query.reshape(batch, kv_heads, heads // kv_heads * n, dim)


def causal_after(queries: int, earlier: int, device: torch.device | str = "cpu") -> Tensor:
    """``[queries, earlier + queries]`` bool mask: query ``i`` sees the ``earlier`` keys and the
    chunk's own keys up to itself (causal attention of a chunk after cached tokens)."""
    return torch.ones(queries, earlier + queries, dtype=torch.bool, device=device).tril(earlier)


def packed_attention(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_mask: PackedBlockMask,
    window: int | None = None,
    cap: float | None = None,
    scale: float | None = None,
) -> Tensor:
    """Attention of a ragged step's packed ``query`` ``[1, Hq, T, D]`` over the pools.

    Each region is one compiled FlexAttention call: the decode tokens as a batch of one-token
    rows (``[n, Hq, 1, D]``, each row listing its own pages, as a ``generate()`` decode step,
    padded here to the plan's ``decode_len`` rows), the prefill chunks in blocks of
    ``chunk_block`` tokens.
    Where the C decode kernel reads the pools from C++ (``native_decode``), every decode token is
    attended by it (``flexpage::paged_decode``, its keys found through the page table); else, where
    SDPA over a sequence's pages is the faster kernel (``sdpa_over_pages``), a lone decode token is
    attended that way. Where SDPA is, each prefill chunk is too, in a call of its own.
    ``window`` and ``cap`` select the layer's variant (sliding window, logit soft-cap; a window the
    page table keeps window rows for reads them, ``PackedBlockMask.for_window``).
    Quantised pools (``flexpage.core.quant``) are dequantised where they are read: in the SDPA
    path's slice or gather, and for FlexAttention (whose pools are in the query's dtype) into a
    scratch pool at the slots of the step's pages (``PackedBlockMask.read_slots``).
    Returns ``[1, Hq, T, Dv]``.
    """
    if isinstance(block_mask, StaticDecodeMask) and torch.compiler.is_compiling():  # one opaque call
        if native_decode(query, key_pool):
            return _paged_decode(query, key_pool, value_pool, block_mask.for_window(window), window, cap, scale)
        return static_decode_attention(query, key_pool, value_pool, block_mask.plan.tok_pos, window, cap, scale)
    block_mask = block_mask.for_window(window)  # a windowed layer whose pages its rows' window rows hold
    plan = block_mask.plan
    if query.shape[0] != 1 or query.dim() != 4 or query.shape[2] != plan.q_len:
        raise ValueError(
            f"a packed step takes a query of shape (1, heads, {plan.q_len}, dim), got {tuple(query.shape)}"
        )
    outputs = []
    decoded = plan.decode_tokens  # the decode region's positions (all decode_len rows in a compiled step)
    if decoded and native_decode(query, key_pool):
        if not torch.compiler.is_compiling():  # (a traced forward's variants are known before it)
            block_mask.note_decode(window, cap)
        outputs.append(_paged_decode(query[:, :, :decoded], key_pool, value_pool, block_mask, window, cap, scale))
    elif decoded and block_mask.lone_decode_row() and sdpa_over_pages(query.device, cap, 1):
        # one sequence's decode token(s): one SDPA call over its pages; padding rows keep zeros (never read)
        kv = block_mask.decode_kv(window)
        fed = len(block_mask.fed_decode_rows())
        out = sequence_attention(query[:, :, :fed], key_pool, value_pool, kv, scale)
        outputs.append(out if fed == decoded else F.pad(out, (0, 0, 0, decoded - fed)))
    elif decoded and (out := _decode_rows_by_kernel(query, key_pool, value_pool, block_mask, window, cap,
                                                    scale)) is not None:
        outputs.append(out)
    elif decoded:  # a batch of one-token rows: [1, H, n, D] -> [decode_len, H, 1, D] -> [1, H, n, D]
        group = query_group(query, key_pool) if block_mask.group is None else block_mask.group
        mask, score_mod = block_mask.decode_region(window, cap, group)
        key_pool, value_pool = _flex_pools(query, key_pool, value_pool, block_mask)
        rows = F.pad(query[0, :, :decoded].transpose(0, 1), (0, 0, 0, 0, 0, plan.decode_len - decoded))
        rows = rows.contiguous()[:, :, None]  # padding nothing keeps the transposed strides: the kernel reads rows
        out = rows_attention(rows, key_pool, value_pool, mask, score_mod, scale, group)
        outputs.append(out[:decoded, :, 0].transpose(0, 1)[None])
    if plan.q_len > decoded and sdpa_over_pages(query.device, cap, 1):  # one SDPA call per chunk
        region = query.new_zeros(1, query.shape[1], plan.q_len - decoded, value_dim(value_pool))
        start = 0  # padding positions keep zeros: their outputs are never read
        for (_, n), kv in zip(plan.chunks, block_mask.chunk_kvs(window)):
            chunk = query[:, :, decoded + start : decoded + start + n]
            region[:, :, start : start + n] = sequence_attention(chunk, key_pool, value_pool, kv, scale)
            start += cdiv(n, plan.chunk_block) * plan.chunk_block
        outputs.append(region)
    elif plan.q_len > decoded:
        key_pool, value_pool = _flex_pools(query, key_pool, value_pool, block_mask)
        outputs.append(_region_attention(query, key_pool, value_pool, block_mask.region("chunk", window, cap), scale))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _decode_rows_by_kernel(query: Tensor, key_pool: Tensor, value_pool: Tensor, block_mask: PackedBlockMask,
                           window: int | None, cap: float | None, scale: float | None) -> Tensor | None:
    """The decode region of a step (``[1, Hq, decode_tokens, D]``) by the C kernel in one call,
    every row's keys read in place (scores soft-capped at ``cap``), where the policy gives it the
    pools' dtype; None where it does not apply (a row fed several tokens, traced, no kernel).
    Padding rows keep zeros (never read)."""
    rows = block_mask.fed_decode_rows()
    if (key_pool.dtype not in device_policy(query.device).decode_kernel_dtypes
            or len(set(rows)) != len(rows) or torch.compiler.is_compiling()):
        return None
    fed = query[0, :, : len(rows)].transpose(0, 1)[:, :, None]  # [rows, H, 1, D]
    out = decode_attention(fed, key_pool, value_pool, *block_mask.decode_runs(window), scale, cap)
    if out is None:
        return None
    return F.pad(out[:, :, 0].transpose(0, 1)[None], (0, 0, 0, block_mask.plan.decode_tokens - len(rows)))


def _flex_pools(query: Tensor, key_pool: Tensor, value_pool: Tensor, block_mask: PackedBlockMask
                ) -> tuple[Tensor, Tensor]:
    """The pools FlexAttention reads for this step: quantised pools dequantised (in the query's dtype)
    at the slots of the step's pages into scratch pools; pools of the query's dtype as they are."""
    if not is_quantised(key_pool):
        return key_pool, value_pool
    slots = block_mask.read_slots()
    return (dequantised_pool(key_pool, slots, query.dtype, "keys"),
            dequantised_pool(value_pool, slots, query.dtype, "values"))


def _paged_decode(query: Tensor, key_pool: Tensor, value_pool: Tensor, block_mask: PackedBlockMask,
                  window: int | None, cap: float | None, scale: float | None) -> Tensor:
    """The attention of the first ``query.shape[2]`` tokens of ``block_mask``'s plan (decode tokens,
    padding ones at position -1) by ``flexpage::paged_decode``: each token's keys up to its position
    (within ``window``) found through the page table and read in place, no Python per row."""
    plan, table = block_mask.plan, block_mask.page_table
    tokens = query.shape[2]
    return torch.ops.flexpage.paged_decode(query, key_pool, value_pool, table.table, plan.tok_rows[:tokens],
                                           plan.tok_pos[:tokens], table.page_size, window or 0,
                                           query.shape[-1] ** -0.5 if scale is None else scale, cap or 0.0)


def native_decode(query: Tensor, key_pool: Tensor) -> bool:
    """Whether decode tokens of ``query`` over these pools are attended by ``flexpage::paged_decode``
    (``native_decode_for`` their device, dtypes and heads)."""
    return native_decode_for(query.device, query.dtype, key_pool.dtype, query.shape[1], key_pool.shape[1],
                             query.shape[-1])


def native_decode_for(device: torch.device, dtype: torch.dtype, pool_dtype: torch.dtype, heads: int, kv_heads: int,
                      head_dim: int) -> bool:
    """Whether decode tokens are attended by ``flexpage::paged_decode`` (the C kernel called from
    C++, eager and compiled steps alike): on a device whose policy gives the pools' dtype to the
    kernel, for float32 or bfloat16 queries of at most 16 heads per KV head and 256 values a head,
    where the C++ ops were built (``kernels.native_ops``)."""
    return (pool_dtype in device_policy(device).decode_kernel_dtypes and dtype in (torch.float32, torch.bfloat16)
            and heads % kv_heads == 0 and heads // kv_heads <= 16 and head_dim <= 256 and native_ops_loaded())


@torch.compiler.assume_constant_result
def native_ops_loaded() -> bool:
    """``kernels.native_ops()``, a constant to a traced forward (benchmarks turn it off to time
    the paths it replaces)."""
    return native_ops()


@torch.library.custom_op("flexpage::static_decode_attention", mutates_args=())
def static_decode_attention(query: Tensor, key_pool: Tensor, value_pool: Tensor, tok_pos: Tensor,
                            window: int | None, cap: float | None, scale: float | None) -> Tensor:
    """``packed_attention`` of a static decode step (its mask found by its plan's ``tok_pos``,
    ``masks.static_mask_at``), as one opaque op of the compiled step: it runs the eager kernels
    (grouped query heads, the attention graphs compiled on their own), which inductor's template
    inside a whole compiled forward does not match on the CPU."""
    return packed_attention(query, key_pool, value_pool, static_mask_at(tok_pos), window, cap, scale).contiguous()


@static_decode_attention.register_fake
def _static_decode_attention_shape(query: Tensor, key_pool: Tensor, value_pool: Tensor, tok_pos: Tensor,
                                   window: int | None, cap: float | None, scale: float | None) -> Tensor:
    return query.new_empty(*query.shape[:3], value_dim(value_pool))


def sdpa_over_pages(device: torch.device, cap: float | None, sequences: int) -> bool:
    """Whether a call holding ``sequences`` sequences' queries is attended by SDPA over the
    pages (``sequence_attention``) instead of FlexAttention: on CPU, eagerly, for a lone
    sequence of a layer without a score mod (SDPA has none). Prefill chunks take one call each.

    On CPU, for one decode token or one prefill chunk, SDPA is faster than the FlexAttention
    template and skips the compiled call's per-call dispatch. For a batch of decode tokens,
    gathering every sequence's keys to a common width costs more than the FlexAttention call,
    which reads each sequence's own pages, and a call per token would multiply the dispatch.
    """
    return (sequences == 1 and cap is None and device_policy(device).sdpa_lone_sequence
            and not torch.compiler.is_compiling())


def _region_attention(query: Tensor, key_pool: Tensor, value_pool: Tensor, region, scale: float | None) -> Tensor:
    # The region's query is made contiguous so its compiled graph depends on the region's own
    # size only, not on the size of the step it was cut from.
    start, end, mask, score_mod = region
    return paged_attention(query[:, :, start:end].contiguous(), key_pool, value_pool, mask, score_mod, scale)
