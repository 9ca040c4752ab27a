"""BlockMasks and mods for paged attention, built straight from the page table.

FlexAttention sees one pool of ``(num_pages + 1) * page_size`` physical KV slots. The
BlockMask of a step lists, for every batch row and query block, only that row's own pages
(KV block size = page size, so a block never spans two pages and results never depend on
where pages land). Logical mask/score mods are remapped to physical slots through the
table's per-page logical index and always bounded by the row's length, so unwritten slots
of a last, partly-filled page are never read.

Mods are written in logical coordinates (``q_idx`` / ``kv_idx`` are token positions in the
sequence), as the library in ``flexpage.mods`` is.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from .compile import compile_static
from .mods import MaskMod, ScoreMod, causal, sliding_window, softcap
from .host import cdiv
from .pages import PackedPlan, PageTable, StepPlan
from .policy import device_policy


Q_BLOCK_SIZE = 128
# a lone sequence's queries attend their keys run by run (``SequenceKV.runs``) where the runs of consecutive
# slots average at least this many keys: then the calls cost less than gathering the keys
RUN_TOKENS = 1024


# ---------------------------------------------------------------------------- remapping
def metadata_width(page_table: PageTable) -> int:
    """Columns of ``kv_indices``: a row's page budget, except where a backend needs more.

    Inductor's CPU FlexAttention template asserts ``KV_LEN <= kv_indices.size(-1) * KV_BLOCK``,
    so on CPU the columns must cover the whole pool (sink page included). Elsewhere the
    metadata stays sized by batch x pages-per-sequence, independent of the pool.
    """
    if device_policy(page_table.device).pool_wide_metadata:
        return page_table.num_pages + 1
    return page_table.max_pages_per_seq


def _logical_kv(page_table: PageTable) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """``kv_idx`` (a pool slot) -> (its logical page, its logical position). The mods capture
    this, not the PageTable: a compiled kernel's signature covers what its mods capture."""
    page_logical, page_size = page_table.page_logical, page_table.page_size

    def logical_kv(kv_idx: Tensor) -> tuple[Tensor, Tensor]:
        logical_page = page_logical[kv_idx // page_size]
        return logical_page, logical_page * page_size + kv_idx % page_size

    return logical_kv


def paged_mask_mod(page_table: PageTable, plan: StepPlan | DecodeRows, mask_mod: MaskMod | None = None
                   ) -> MaskMod:
    """Physical-slot mask for a step: the row's own, written tokens, then ``mask_mod``
    (default ``causal``) in logical positions. ``b`` is the step's batch index."""
    mask_mod = causal if mask_mod is None else mask_mod
    q_start, kv_lens, to_logical = plan.q_start, plan.kv_lens, _logical_kv(page_table)

    def paged_mask(b, h, q_idx, kv_idx):
        logical_page, logical_kv = to_logical(kv_idx)
        written = (logical_page >= 0) & (logical_kv < kv_lens[b])
        return written & mask_mod(b, h, q_start[b] + q_idx, logical_kv)

    return paged_mask


def paged_score_mod(page_table: PageTable, plan: StepPlan | DecodeRows, score_mod: ScoreMod) -> ScoreMod:
    """Physical-slot version of a logical ``score_mod`` for a step."""
    q_start, to_logical = plan.q_start, _logical_kv(page_table)

    def paged_score(score, b, h, q_idx, kv_idx):
        _, logical_kv = to_logical(kv_idx)
        return score_mod(score, b, h, q_start[b] + q_idx, logical_kv)

    return paged_score


def packed_mask_mod(
    page_table: PageTable, tok_rows: Tensor, tok_pos: Tensor, mask_mod: MaskMod | None = None
) -> MaskMod:
    """Physical-slot mask for packed query tokens: token ``q_idx`` belongs to row
    ``tok_rows[q_idx]`` at logical position ``tok_pos[q_idx]`` (-1: padding, sees nothing).
    ``mask_mod`` (default ``causal``) gets the row as ``b`` and logical positions."""
    mask_mod = causal if mask_mod is None else mask_mod
    lens, to_logical = page_table.lens, _logical_kv(page_table)

    def packed_mask(b, h, q_idx, kv_idx):
        row, pos = tok_rows[q_idx], tok_pos[q_idx]
        logical_page, logical_kv = to_logical(kv_idx)
        written = (logical_page >= 0) & (logical_kv < lens[row]) & (pos >= 0)
        return written & mask_mod(row, h, pos, logical_kv)

    return packed_mask


def packed_score_mod(page_table: PageTable, tok_rows: Tensor, tok_pos: Tensor, score_mod: ScoreMod) -> ScoreMod:
    """Physical-slot version of a logical ``score_mod`` for packed query tokens."""
    to_logical = _logical_kv(page_table)

    def packed_score(score, b, h, q_idx, kv_idx):
        _, logical_kv = to_logical(kv_idx)
        return score_mod(score, tok_rows[q_idx], h, tok_pos[q_idx], logical_kv)

    return packed_score


def grouped_mask_mod(mask_mod: MaskMod, group: int) -> MaskMod:
    """``mask_mod`` of one-token rows for a query laid out as ``[B, kv_heads, group, D]``: the
    ``group`` query heads that share a KV head run along the query axis, so each KV block is
    read once per KV head instead of once per query head (grouped-query attention on CPU).
    Query index ``q`` of head ``h`` is query head ``h * group + q`` at the row's one query."""

    def grouped_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h * group + q_idx, q_idx * 0, kv_idx)

    return grouped_mask


def grouped_score_mod(score_mod: ScoreMod, group: int) -> ScoreMod:
    """``score_mod`` for one-token rows with grouped query heads (see ``grouped_mask_mod``)."""

    def grouped_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h * group + q_idx, q_idx * 0, kv_idx)

    return grouped_score


def _grouped_score(score_mod: ScoreMod, group: int) -> ScoreMod:
    return score_mod if group == 1 else grouped_score_mod(score_mod, group)


def build_block_mask(
    page_table: PageTable,
    plan: StepPlan,
    mask_mod: MaskMod | None = None,
    q_block_size: int = Q_BLOCK_SIZE,
) -> BlockMask:
    """The step's BlockMask, from the page table in O(batch x query blocks x pages-per-seq).

    Each query block lists its row's pages up to the last one it may see (when the mask
    declares ``within_causal``, pages past the block's last query are skipped). With the
    default causal mask, pages entirely visible to every query of the block are "full"
    blocks, for which the kernel skips mask evaluation.
    """
    return _build(page_table, plan, mask_mod, q_block_size)


class _StepMask(BlockMask):
    """A step's mask that builds its FlexAttention metadata only when a layer asks for it.

    transformers passes a 4-D BlockMask through to every layer untouched, so each step's mask
    is one of these; BlockMask attributes (``kv_indices``, ``mask_mod``, ...) come from the
    step's causal mask, built on first use. Variants a layer asks for are built once per step
    and shared by every layer that asks.
    """

    page_table: PageTable

    def _start(self, page_table: PageTable, q_len: int, batch: int) -> None:
        self.page_table, self._variants, self._batch = page_table, {}, batch
        self.seq_lengths = (q_len, (page_table.num_pages + 1) * page_table.page_size)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self._batch, 1, *self.seq_lengths)

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("page_table", "plan"):
            raise AttributeError(name)
        return getattr(self._causal(), name)

    def to(self, device: torch.device | str) -> "_StepMask":
        """Itself: accelerate's hooks move every forward input to a layer's device with ``.to``,
        which on a plain BlockMask would build the metadata and drop the step (plan, pages)."""
        return self

    def _causal(self) -> BlockMask:
        raise NotImplementedError

    def _variant(self, key: tuple, build: Callable[[], object]):
        if key not in self._variants:
            self._variants[key] = build()
        return self._variants[key]


@dataclass(frozen=True)
class SequenceKV:
    """The slots of one sequence's last ``width`` keys (its newest token last): a plain slice of
    the pool, ``start:start + width``, when they fill consecutive slots; where the keys lie in a
    few long ``runs`` of consecutive slots, for a decode token or a causal chunk, those runs
    (``(first slot, keys)`` each, attended one call each, nothing copied); else the ``slots`` to
    gather. A step that feeds the sequence several queries (a prefill chunk) attends its own
    tokens causally (``causal``: the keys are exactly the chunk's, SDPA's unmasked causal path)
    after ``earlier`` keys that every query sees whole; ``allowed`` (``[queries, width]`` bool)
    masks keys per query only where a sliding window cuts them. One query sees every key."""

    width: int
    start: int | None  # first slot when the keys are stored contiguously, else None
    slots: Tensor | None  # [width] int64 pool slots (None when ``start`` is set)
    allowed: Tensor | None = None
    causal: bool = False
    earlier: int = 0  # keys before the chunk's own (``causal`` chunks only)
    runs: tuple[tuple[int, int], ...] = ()  # (first slot, keys) of each run, where ``start`` and ``slots`` are None

    def key_runs(self) -> tuple[tuple[int, int], ...]:
        """``(first slot, keys)`` of each run of consecutive slots holding the keys, in key order,
        whichever way they are described."""
        if self.runs:
            return self.runs
        if self.start is not None:
            return ((self.start, self.width),)
        slots = self.slots.cpu()
        firsts = [0, *((slots[1:] != slots[:-1] + 1).nonzero().flatten() + 1).tolist(), self.width]
        return tuple((int(slots[a]), b - a) for a, b in zip(firsts, firsts[1:]))

    @functools.cached_property
    def kernel_runs(self) -> tuple[Tensor, Tensor]:
        """``run_arrays`` of these keys, built once: every layer's decode token reads them."""
        return run_arrays([self.key_runs()])

    @classmethod
    def for_row(cls, page_table: PageTable, row: int, window: int | None, queries: int = 1) -> "SequenceKV":
        """The keys the last ``queries`` tokens of ``row`` attend (causal, within ``window``)."""
        page, length = page_table.page_size, page_table.seq_lens[row]
        first = 0 if window is None else max(0, length - queries + 1 - window)
        pages = page_table.seq_pages[row][first // page : cdiv(length, page)]
        allowed, causal = None, queries > 1 and (window is None or queries == length - first and queries <= window)
        if queries > 1 and not causal:
            q_pos = torch.arange(length - queries, length)[:, None]
            k_pos = torch.arange(first, length)[None, :]
            allowed = k_pos <= q_pos if window is None else (k_pos <= q_pos) & (q_pos - k_pos < window)
            allowed = allowed.to(page_table.device)
        earlier = length - first - queries if causal else 0
        if pages == list(range(pages[0], pages[0] + len(pages))):
            return cls(length - first, pages[0] * page + first % page, None, allowed, causal, earlier)
        if (queries == 1 or causal) and device_policy(page_table.device).split_chunk_attention:
            runs = _runs(pages, page, first % page, length - first)
            if len(runs) * RUN_TOKENS <= length - first:
                return cls(length - first, None, None, allowed, causal, earlier, runs)
        slots = page_table.slots_of(pages)[first % page :][: length - first]
        return cls(length - first, None, slots.to(page_table.device), allowed, causal, earlier)


def _runs(pages: Sequence[int], page_size: int, skip: int, width: int) -> tuple[tuple[int, int], ...]:
    """``(first slot, keys)`` of each run of consecutive slots holding ``width`` keys that start
    ``skip`` slots into the first of ``pages``."""
    runs: list[list[int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page * page_size:
            runs[-1][1] += page_size
        else:
            runs.append([page * page_size, page_size])
    runs[0][0] += skip
    runs[0][1] -= skip
    runs[-1][1] -= sum(n for _, n in runs) - width  # the last page's unwritten slots
    return tuple((start, n) for start, n in runs)


def run_arrays(rows: Sequence[tuple[tuple[int, int], ...]]) -> tuple[Tensor, Tensor]:
    """Several sequences' keys as runs of consecutive slots (``SequenceKV.key_runs`` each) in two
    int64 tensors: ``first_run`` ``[R + 1]`` (sequence ``r``'s runs are ``first_run[r]`` to
    ``first_run[r + 1]``) and ``runs`` ``[2, n]`` (each run's first slot, then its keys)."""
    first_run = torch.tensor([0, *itertools.accumulate(len(runs) for runs in rows)], dtype=torch.int64)
    runs = torch.tensor([run for runs in rows for run in runs], dtype=torch.int64).reshape(-1, 2)
    return first_run, runs.T.contiguous()


def _build(page_table: PageTable, plan: StepPlan | DecodeRows, mask_mod: MaskMod | None, q_block_size: int,
           group: int = 1) -> BlockMask:
    """The step's BlockMask; ``group > 1`` (one-token rows only) for a query whose grouped heads
    run along the query axis (``grouped_mask_mod``): same blocks, ``group`` query positions."""
    paged_mask = paged_mask_mod(page_table, plan, mask_mod)
    return BlockMask.from_kv_blocks(
        *_metadata(page_table, plan, mask_mod, q_block_size, group),
        BLOCK_SIZE=(q_block_size, page_table.page_size),
        mask_mod=paged_mask if group == 1 else grouped_mask_mod(paged_mask, group),
        seq_lengths=(plan.q_len * group, (page_table.num_pages + 1) * page_table.page_size),
        compute_q_blocks=False,
    )


def _metadata(page_table: PageTable, plan: StepPlan | DecodeRows, mask_mod: MaskMod | None, q_block_size: int,
              group: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step's ``kv_num_blocks``, ``kv_indices`` and their full-block twins (``_block_metadata``)."""
    # one-token rows on CPU take inductor's decoding template, which needs rows listing equal
    # block counts (``_block_metadata``); grouped rows (a query per head of the group) take the
    # attention template, which walks each row's own blocks, so they list exactly their pages
    uniform = (plan.q_len == 1 and group == 1 and device_policy(page_table.device).uniform_decode_rows
               and len(plan.rows) > 1)
    return _block_metadata(
        page_table.table,
        plan.rows,
        plan.q_start,
        plan.kv_lens,
        page_size=page_table.page_size,
        q_len=plan.q_len,
        q_block_size=q_block_size,
        width=metadata_width(page_table),
        sink_page=page_table.num_pages,
        prune_causal=getattr(causal if mask_mod is None else mask_mod, "within_causal", False),
        full_causal=mask_mod is None,
        uniform=uniform,
    )


@compile_static
def _block_metadata(
    table: Tensor,
    rows: Tensor,
    q_start: Tensor,
    kv_lens: Tensor,
    *,
    page_size: int,
    q_len: int,
    q_block_size: int,
    width: int,
    sink_page: int,
    prune_causal: bool,
    full_causal: bool,
    uniform: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """kv_num_blocks / kv_indices / full_kv_num_blocks / full_kv_indices for one step.

    Compiled into one fused kernel: the tensor work is a few dozen tiny ops whose dispatch
    overhead alone would exceed the per-step budget.
    """
    batch, seq_width = rows.shape[0], table.shape[1]
    num_q_blocks = (q_len + q_block_size - 1) // q_block_size
    device = table.device
    table = table[rows]  # [B, seq_width]
    table = torch.where(table < 0, sink_page, table)  # unused columns and released pages: the sink, never attended
    kv_lens = kv_lens.long()[:, None]  # [B, 1]
    q_block_start = torch.arange(num_q_blocks, device=device) * q_block_size  # [R]
    first_q = q_start.long()[:, None] + q_block_start  # [B, R]
    last_q = q_start.long()[:, None] + (q_block_start + q_block_size).clamp_max(q_len) - 1
    num_pages = (kv_lens + page_size - 1) // page_size
    visible = num_pages.expand(batch, num_q_blocks)
    if prune_causal:  # pages past the block's last query are invisible
        visible = torch.minimum(((last_q + 1).clamp_min(0) + page_size - 1) // page_size, num_pages)
    full = torch.zeros_like(visible)
    if full_causal:  # pages wholly before the block's first query need no mask
        full = torch.minimum(kv_lens // page_size, (first_q + 1).clamp_min(0) // page_size)
        full = torch.minimum(full, visible)
    if uniform:
        # Inductor's CPU decode template splits a row's KV work into partitions of its listed
        # blocks only when every row lists the same number of blocks; otherwise it partitions
        # the whole pool, so cost follows capacity, not live tokens. Shorter rows list sink-page
        # entries, which the mask rejects.
        visible = visible.amax().expand_as(visible)
        full = full.amin().expand_as(full)
    cols = torch.arange(seq_width, device=device)
    partial_cols = full[..., None] + cols  # [B, R, seq_width]
    partial = table[:, None, :].expand(batch, num_q_blocks, seq_width).gather(2, partial_cols.clamp_max(seq_width - 1))
    # Columns past a row's own pages point at the sink page, which the mask always rejects.
    partial = torch.where(partial_cols < num_pages[..., None], partial, sink_page)
    pad = width - seq_width
    kv_indices = torch.nn.functional.pad(partial, (0, pad)).to(torch.int32)[:, None]
    full_indices = torch.nn.functional.pad(table, (0, pad))[:, None, None, :].expand(batch, 1, num_q_blocks, width)
    return (
        (visible - full).to(torch.int32)[:, None],
        kv_indices,
        full.to(torch.int32)[:, None],
        full_indices.contiguous(),
    )


@dataclass(frozen=True)
class DecodeRows:
    """A ragged step's decode tokens laid out as a batch of one-token rows (the layout of a
    ``generate()`` decode step, and the only one FlexAttention's GPU decode kernel accepts):
    row ``b`` is page-table row ``rows[b]``, its query at logical position ``q_start[b]`` sees
    ``kv_lens[b]`` tokens (0 for a padding row, which sees nothing)."""

    rows: Tensor
    q_start: Tensor
    kv_lens: Tensor
    q_len: int = 1

    @classmethod
    def of(cls, plan: PackedPlan) -> "DecodeRows":
        """The plan's decode tokens as its ``decode_len`` rows, the rows past them empty."""
        pad = (0, plan.decode_len - plan.num_decode)
        pos = plan.tok_pos[: plan.num_decode]
        rows = torch.nn.functional.pad(plan.tok_rows[: plan.num_decode], pad)
        return cls(rows, torch.nn.functional.pad(pos, pad), torch.nn.functional.pad(pos + 1, pad))


class PackedBlockMask(_StepMask):
    """The mask of a ragged (packed) step: one query row holding many sequences' tokens.

    The step has two regions: decode tokens (one per sequence) and prefill chunks (blocks of
    ``chunk_block`` tokens of one row). Each region's FlexAttention metadata is built from the
    page table when a layer asks for it (``region``): the decode tokens as a batch of one-token
    rows (``DecodeRows``) each listing its own pages, chunk blocks listing their row's pages
    with those wholly before the block as full blocks. Every query block is 16 tokens or more
    (a decode row's one query sits in a block of ``Q_BLOCK_SIZE``), as the GPU kernels require.
    On CPU a lone decode token, and each prefill chunk, is attended by SDPA over its sequence's
    pages instead (``decode_kv``, ``chunk_kvs``), and such a region builds no block metadata.
    Layers attending the page table's ``sliding_window`` where it keeps window rows read theirs
    through ``window_mask`` (``for_window``).
    """

    plan: PackedPlan
    group: int | None = None  # the decode rows' query heads per KV head, where the mask fixes it (static steps)
    window_mask: "PackedBlockMask | None" = None  # the same step over the window rows (``plan.window_plan``)

    @classmethod
    def for_step(cls, page_table: PageTable, plan: PackedPlan) -> "PackedBlockMask":
        mask = cls.__new__(cls)
        mask._start(page_table, plan.q_len, 1)
        mask.plan = plan
        mask.BLOCK_SIZE = (Q_BLOCK_SIZE if plan.decode_len else plan.chunk_block, page_table.page_size)
        if plan.window_plan is not None:
            mask.window_mask = PackedBlockMask.for_step(page_table, plan.window_plan)
        return mask

    def for_window(self, window: int | None) -> "PackedBlockMask":
        """The mask of a layer attending ``window``: the window rows' where the page table keeps its
        windowed layers' pages there, else this one."""
        if self.window_mask is not None and window is not None and window == self.page_table.sliding_window:
            return self.window_mask
        return self

    def _causal(self) -> BlockMask:
        return self.region("decode" if self.plan.decode_len else "chunk")[2]

    def region(self, name: str, window: int | None = None, cap: float | None = None, group: int = 1
               ) -> tuple[int, int, BlockMask, ScoreMod | None]:
        """``(start, end, block_mask, score_mod)`` of the ``"decode"`` or ``"chunk"`` region, for
        a causal mask restricted to a sliding ``window`` and scores soft-capped at ``cap``. The
        decode region's mask is for its tokens as a batch of ``decode_len`` one-token rows
        (``DecodeRows``; ``end`` counts the real ones), with ``group`` query heads along the query
        axis (``grouped_mask_mod``)."""
        plan = self.plan
        if name == "decode":
            return (0, plan.num_decode, *self.decode_region(window, cap, group))
        start, end, q_block = plan.decode_tokens, plan.q_len, plan.chunk_block
        if cap is not None:  # the same block metadata as without soft-capping, plus the score mod
            rows, pos = plan.tok_rows[start:end], plan.tok_pos[start:end]
            return self._variant((name, window, cap), lambda: (
                *self.region(name, window)[:3], packed_score_mod(self.page_table, rows, pos, softcap(cap))))
        return self._variant((name, window, None), lambda: (
            start, end, _region_mask(self.page_table, plan, start, end, q_block, window), None))

    def decode_region(self, window: int | None = None, cap: float | None = None, group: int = 1
                      ) -> tuple[BlockMask, ScoreMod | None]:
        """The decode region's ``(block_mask, score_mod)``: its tokens as a batch of ``decode_len``
        one-token rows (``DecodeRows``) with ``group`` query heads along the query axis. Built
        once per step and variant; a compiled step gets them built before it runs (``prepare``)."""
        plan = self.plan
        rows = self._variant(("decode_rows",), lambda: DecodeRows.of(plan))
        mask_mod = None if window is None else sliding_window(window)
        return self._variant(("decode", window, cap, group), lambda: (
            _build(self.page_table, rows, mask_mod, Q_BLOCK_SIZE, group),
            None if cap is None else _grouped_score(paged_score_mod(self.page_table, rows, softcap(cap)), group)))

    def windows(self) -> set[int | None]:
        """The sliding windows (None: no window) of the layers that attended through this mask."""
        inner = set() if self.window_mask is None else self.window_mask.windows()
        return inner | {key[1] for key in self._variants if key[0] in ("decode", "decode_kv", "decode_runs",
                                                                        "paged_decode", "chunk", "chunk_kvs")}

    def decode_variants(self) -> set[tuple[int | None, float | None]]:
        """The ``(window, cap)`` variants whose decode region this step's layers asked for (as
        FlexAttention's block mask, as the C kernel's runs, or through ``note_decode``)."""
        inner = set() if self.window_mask is None else self.window_mask.decode_variants()
        return (inner | {(key[1], key[2]) for key in self._variants if key[0] in ("decode", "paged_decode")}
                | {(key[1], None) for key in self._variants if key[0] == "decode_runs"})

    def note_decode(self, window: int | None, cap: float | None) -> None:
        """Record that a layer of variant ``(window, cap)`` attended this step's decode tokens by a
        kernel that reads the page table itself (``attention.native_decode``): what ``windows`` and
        ``decode_variants`` report, as for the variants built here."""
        self._variant(("paged_decode", window, cap), lambda: None)

    def prepare(self, variants: set[tuple[int | None, float | None]]) -> "PackedBlockMask":
        """Build the decode region of each layer variant ``(window, cap)`` now, as a compiled
        forward reads them (it must not build them while being traced). Returns the mask."""
        for window, cap in variants:
            self.decode_region(window, cap)
        return self

    def fed_decode_rows(self) -> tuple[int, ...]:
        """The page-table row of each real decode token (a row repeats for each of its last tokens fed)."""
        return self.plan.decode_rows

    def lone_decode_row(self) -> bool:
        """Whether the decode region is one sequence's, unpadded: a lone decode token."""
        return self.plan.decode_len == self.plan.decode_tokens == 1

    def decode_kv(self, window: int | None = None) -> SequenceKV:
        """Where the keys of a lone sequence's decode tokens live (``lone_decode_row``), for one
        SDPA call over its pages (``SequenceKV``: its fed tokens attend causally)."""
        rows = self.fed_decode_rows()
        return self._variant(("decode_kv", window),
                             lambda: SequenceKV.for_row(self.page_table, rows[0], window, len(rows)))

    def decode_runs(self, window: int | None = None) -> tuple[Tensor, Tensor]:
        """The keys of each fed decode token (one per row: no row fed several) as runs of slots,
        ``run_arrays``' form, for the C kernel's batch of decode tokens."""
        return self._variant(("decode_runs", window), lambda: run_arrays(
            [SequenceKV.for_row(self.page_table, row, window).key_runs() for row in self.fed_decode_rows()]))

    def read_rows(self) -> tuple[int, ...]:
        """The page-table rows whose keys this step reads: its decode rows, then its chunks'."""
        return (*self.fed_decode_rows(), *(row for row, _ in self.plan.chunks))

    def read_slots(self) -> Tensor:
        """Every pool slot of the pages this step's rows hold (where its attention may read)."""
        def slots() -> Tensor:
            table = self.page_table
            pages = sorted({p for row in self.read_rows() for p in table.seq_pages[row][table.first_held[row] :]})
            return table.slots_of(pages).to(table.device)
        return self._variant(("read_slots",), slots)

    def chunk_kvs(self, window: int | None = None) -> list[SequenceKV]:
        """The keys of each prefill chunk's sequence and the chunk's causal mask, for one SDPA
        call per chunk."""
        return self._variant(("chunk_kvs", window), lambda: [
            SequenceKV.for_row(self.page_table, row, window, num_tokens) for row, num_tokens in self.plan.chunks])


# every live static mask, by the address of its plan's ``tok_pos`` (``static_mask_at``)
_STATIC: weakref.WeakValueDictionary[int, "StaticDecodeMask"] = weakref.WeakValueDictionary()


def static_mask_at(tok_pos: Tensor) -> "StaticDecodeMask":
    """The static mask whose plan's ``tok_pos`` is this tensor: how an opaque op of a compiled step
    (which takes tensors only) finds its mask, in this process, whichever process traced it."""
    return _STATIC[tok_pos.data_ptr()]


class StaticDecodeMask(PackedBlockMask):
    """The mask of one decode bucket's compiled step, over a static plan (``PageTable.static_plan``):
    its decode rows and every layer variant's block metadata are tensors built once and rewritten
    in place by ``refresh`` each step, so the compiled step reads the same tensors every time (what
    a captured graph replays). Its rows carry ``group`` query heads per KV head (``head_group``)."""

    @classmethod
    def over(cls, page_table: PageTable, plan: PackedPlan, variants: set[tuple[int | None, float | None]],
             group: int, flex: bool = True) -> "StaticDecodeMask":
        """The mask of the static ``plan``, with the decode region of each ``(window, cap)`` built
        for FlexAttention where ``flex`` (a step whose attention reads the page table itself,
        ``attention.native_decode``, needs none, and its steps then rewrite none)."""
        mask = cls.for_step(page_table, plan)
        mask.group, mask.rows = group, ()
        if plan.window_plan is not None:
            mask.window_mask = cls.over(page_table, plan.window_plan, {v for v in variants if mask.for_window(v[0])
                                                                       is not mask}, group, flex)
        if flex:
            mask._variants[("decode_rows",)] = DecodeRows(plan.tok_rows, plan.tok_pos.clamp_min(0), plan.tok_pos + 1)
            for window, cap in variants:
                if mask.for_window(window) is mask:
                    mask.decode_region(window, cap, group)
        _STATIC[plan.tok_pos.data_ptr()] = mask
        return mask

    def fed_decode_rows(self) -> tuple[int, ...]:
        return self.rows  # ``refresh``'s: the static plan holds its rows in tensors only

    def lone_decode_row(self) -> bool:
        """Whether every fed decode token is one sequence's: a lone decode token, or a speculating
        sequence's last token and drafts fed as decode rows (``PageTable.plan_packed``)."""
        rows = self.rows
        return bool(rows) and rows.count(rows[0]) == len(rows)

    def tensors(self) -> list[Tensor]:
        """Every tensor of the mask that ``refresh`` rewrites: the decode rows' and each variant's
        block metadata (the step reads them where they are: their addresses never change)."""
        rows = self._variants.get(("decode_rows",))
        held = [*(() if rows is None else (rows.q_start, rows.kv_lens)),
                *(() if self.window_mask is None else self.window_mask.tensors())]
        for key, value in self._variants.items():
            if key[0] == "decode":
                block_mask = value[0]
                held += [block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                         block_mask.full_kv_indices]
        return held

    def refresh(self, rows: Sequence[int]) -> None:
        """Rewrite the decode rows and every variant's block metadata from the plan's tensors (written
        for this step's page-table ``rows`` by ``PageTable.plan_packed``) and the page table."""
        self.rows = tuple(rows)
        if self.window_mask is not None:
            self.window_mask.refresh([self.page_table.window_row(row) for row in rows])
        for key in [key for key in self._variants if key[0] in ("decode_kv", "decode_runs", "read_slots")]:  # per step
            del self._variants[key]
        rows = self._variants.get(("decode_rows",))
        if rows is None:  # no FlexAttention metadata (``over``'s ``flex``)
            return
        torch.clamp(self.plan.tok_pos, min=0, out=rows.q_start)  # padding rows (position -1) see nothing
        torch.add(self.plan.tok_pos, 1, out=rows.kv_lens)
        for key, value in self._variants.items():
            if key[0] == "decode":
                _, window, _, group = key
                block_mask = value[0]
                fresh = _metadata(self.page_table, rows, None if window is None else sliding_window(window),
                                  Q_BLOCK_SIZE, group)
                for held, new in zip((block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                                      block_mask.full_kv_indices), fresh):
                    held.copy_(new)


def _region_mask(page_table: PageTable, plan: PackedPlan, start: int, end: int, q_block: int,
                 window: int | None) -> BlockMask:
    rows, pos = plan.tok_rows[start:end], plan.tok_pos[start:end]
    blocks = pos.view(-1, q_block)
    kv_num, kv_indices, full_num, full_indices = _region_metadata(
        page_table, rows[::q_block], blocks[:, 0], blocks.amax(-1), window
    )
    return BlockMask.from_kv_blocks(
        kv_num, kv_indices, full_num, full_indices,
        BLOCK_SIZE=(q_block, page_table.page_size),
        mask_mod=packed_mask_mod(page_table, rows, pos, None if window is None else sliding_window(window)),
        seq_lengths=(end - start, (page_table.num_pages + 1) * page_table.page_size),
        compute_q_blocks=False,
    )


def _region_metadata(
    page_table: PageTable, rows: Tensor, first: Tensor, last: Tensor, window: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Block metadata for query blocks that each belong to one row (``rows[i]``) and hold
    logical positions ``first[i]..last[i]`` (``last < 0``: a padding block, lists nothing).

    Causal: pages wholly before ``first`` are full blocks, the rest up to ``last``'s page
    partial. With a ``window`` every visible page is partial, from the window's first page.
    """
    page_size, sink = page_table.page_size, page_table.num_pages
    table = page_table.table[rows]  # [N, seq_width]
    seq_width = table.shape[1]
    real = last >= 0
    visible = torch.where(real, last // page_size + 1, 0)
    if window is None:
        full = torch.where(real, (first + 1) // page_size, 0)
        start = full
    else:
        full = torch.zeros_like(visible)
        start = torch.where(real, (first - window + 1).clamp_min(0) // page_size, 0)
    cols = torch.arange(seq_width, device=table.device)
    partial_cols = start[:, None] + cols
    partial = table.gather(1, partial_cols.clamp_max(seq_width - 1))
    partial = torch.where(partial_cols < visible[:, None], partial, sink)
    pad = metadata_width(page_table) - seq_width
    as_meta = lambda x: x.to(torch.int32)[None, None]  # noqa: E731
    return (
        as_meta(visible - start),
        as_meta(torch.nn.functional.pad(partial, (0, pad), value=sink)),
        as_meta(full),
        as_meta(torch.nn.functional.pad(table.clamp_min(0), (0, pad), value=sink)),
    )
