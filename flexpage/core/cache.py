"""PagedKVCache: per-layer K/V page pools behind one page table, as a transformers Cache."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import memory
from .host import cdiv
from .quant import dequantise, is_quantised, kv_storage_dtype, pool_width, quantise
from .pages import PackedPlan, PageTable, StepPlan, check_packed_layout
from .step_shape import StepShape

if TYPE_CHECKING:
    from .masks import PackedBlockMask

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_page_size(page_size: int) -> None:
    """FlexAttention uses the page as its KV block, so the page must be a legal KV block size.

    Triton kernels (GPU) tile the KV block with power-of-two tiles of at least 16 tokens and
    require the block to be a multiple of the tile; the CPU template accepts any size. We
    accept what works on both: a power of two >= 16.
    """
    if not isinstance(page_size, int) or isinstance(page_size, bool):
        raise ValueError(f"page_size must be an int, got {type(page_size).__name__}")
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(
            f"page_size must be a power of two >= 16 (it is FlexAttention's KV block size), got {page_size}"
        )


def windowed_layers(config: Any, num_layers: int) -> tuple[int | None, frozenset[int]]:
    """``(window, layers)``: the layers that attend a sliding ``window`` where the others attend every
    position (Gemma 2's alternating layers), from the config's ``layer_types``; ``(None, {})`` where
    every layer is alike (a model whose every layer has a window learns it: ``learn_window``)."""
    types, window = getattr(config, "layer_types", None), getattr(config, "sliding_window", None)
    if not types or not isinstance(window, int) or len(types) != num_layers:
        return None, frozenset()
    layers = frozenset(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return (window, layers) if 0 < len(layers) < num_layers else (None, frozenset())


def pages_for_tokens(config: Any, tokens: int, page_size: int) -> int:
    """Pages of a pool holding ``tokens`` tokens of every layer's K/V in the bytes they take where
    every layer has pools of its own: where windowed layers share the global layers' pools
    (``windowed_layers``), as many more pages as there are fewer pools (twice as many for Gemma 2)."""
    num_layers = getattr(config, "num_hidden_layers", None) or 1
    _, windowed = windowed_layers(config, num_layers)
    pools = max(len(windowed), num_layers - len(windowed))
    return cdiv(tokens, page_size) * num_layers // pools


@dataclass(frozen=True)
class CacheStats:
    pages_total: int
    pages_used: int
    pages_free: int
    live_tokens: int
    reserved_slots: int
    utilisation: float  # live_tokens / reserved_slots (1.0 when nothing is reserved)
    pages_cached: int = 0  # prefix-cache pages nobody holds, kept until the pool needs them (counted free)
    # live_tokens counts slots: where windowed layers keep their own pages (``PageTable.sliding_window``)
    # a token within its sequence's window holds a slot in each of its two rows


class PagedLayer(CacheLayerMixin):
    """One decoder layer's K and V pools, shaped ``[1, kv_heads, (num_pages + 1) * page_size, width]``:
    ``width`` is ``head_dim``, or for quantised pages ``head_dim`` values and their scale
    (``flexpage.core.quant``).

    The extra page at the end is the sink that absorbs padding writes; it is never attended.
    """

    # transformers compiles decode forwards over caches whose layers are all compileable; flexpage
    # compiles its own static steps instead (``static_step``), so generate() never does
    is_compileable = False
    is_croppable = True  # ``PagedKVCache.crop`` truncates rows: assisted generation's rollback

    def __init__(self, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 shares: "PagedLayer | None" = None):
        super().__init__()
        self.device = device
        shape = (1, num_kv_heads, num_slots, pool_width(head_dim, dtype))
        if shares is not None:  # a windowed layer in a global layer's pools: their pages are distinct
            self.keys, self.values = shares.keys, shares.values
        else:
            self.keys = memory.zeros(shape, dtype, device)  # on the CPU on huge pages: decode reads them scattered
            self.values = memory.zeros(shape, dtype, device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Pools are allocated once in ``__init__``; nothing is lazy."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise TypeError("PagedLayer is written through PagedKVCache.update")

    def write(self, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store ``[B, kv_heads, Q, head_dim]`` states at ``slots`` ``[B, Q]``."""
        flat = slots.reshape(-1).to(self.device)
        for pool, states in ((self.keys, key_states), (self.values, value_states)):
            b, h, q, d = states.shape
            rows = states if b == 1 else states.transpose(0, 1).reshape(1, h, b * q, d)
            rows = quantise(rows, pool.dtype) if is_quantised(pool) else rows.to(pool.dtype)
            # Into the pool itself, not a view of it: inductor then writes a compiled forward's
            # copy in place; through a view it copied the whole pool back every step.
            if pool.dtype == torch.float8_e4m3fn:  # no index_copy_ for float8 on the CPU
                pool[:, :, flat] = rows
            else:
                pool.index_copy_(2, flat, rows)

    def copy_page(self, src: int, dst: int, page_size: int) -> None:
        for pool in (self.keys, self.values):
            pool[:, :, dst * page_size : (dst + 1) * page_size] = pool[:, :, src * page_size : (src + 1) * page_size]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        raise TypeError("sequence lengths live in PagedKVCache.page_table")

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class PagedKVCache(Cache):
    """The global paged KV cache: one page table, one K/V pool pair per layer.

    Every layer's pool has the same fixed shape for the cache's lifetime, so compiled
    attention over it never recompiles as sequences grow. A step is ``begin_step`` (reserve
    pages, compute slots) followed by one ``update`` per layer (write K/V, get the pools).
    ``kv_dtype`` stores the pages in ``dtype`` (None) or quantised, ``"int8"`` or
    ``"float8_e4m3fn"`` (``flexpage.core.quant``: a scale per token and KV head beside the values).

    Where the config names layers that attend a sliding window beside layers that attend every
    position (``windowed_layers``: Gemma 2), the windowed layers' K/V live in their rows' window rows
    (``PageTable.sliding_window``), which give back the pages before the window, and each windowed
    layer shares a global layer's pool tensors (a page is one row's at a time): a long sequence then
    holds its windowed layers' last window only.
    """

    def __init__(
        self,
        config: Any = None,
        *,
        page_size: int = 16,
        num_pages: int,
        max_batch_size: int,
        max_pages_per_seq: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | Sequence[torch.device | str] = "cpu",
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kv_dtype: str | torch.dtype | None = None,
    ) -> None:
        check_page_size(page_size)
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        storage = kv_storage_dtype(kv_dtype, dtype)
        num_layers = num_layers or getattr(config, "num_hidden_layers", None)
        num_heads = getattr(config, "num_attention_heads", None)
        num_kv_heads = num_kv_heads or getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = head_dim or getattr(config, "head_dim", None)
        if head_dim is None and config is not None:
            head_dim = config.hidden_size // num_heads
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int (from config or given), got {value!r}")
        devices = [device] * num_layers if isinstance(device, (str, torch.device)) else list(device)
        if len(devices) != num_layers:
            raise ValueError(f"device lists {len(devices)} devices for {num_layers} layers")
        devices = [torch.device(d) for d in devices]
        window, self.windowed = windowed_layers(config, num_layers)
        self.page_table = PageTable(num_pages, page_size, max_batch_size, max_pages_per_seq, devices[0], window)
        num_slots = (num_pages + 1) * page_size  # + the sink page
        layers: dict[int, PagedLayer] = {}
        full = [i for i in range(num_layers) if i not in self.windowed]
        for i in full:
            layers[i] = PagedLayer(num_slots, num_kv_heads, head_dim, storage, devices[i])
        for k, i in enumerate(sorted(self.windowed)):  # the k-th windowed layer in the k-th global one's pools
            partner = layers[full[k]] if k < len(full) and devices[full[k]] == devices[i] else None
            layers[i] = PagedLayer(num_slots, num_kv_heads, head_dim, storage, devices[i], partner)
        super().__init__(layers=[layers[i] for i in range(num_layers)])
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # the model's: K/V arrive and attention reads them in it
        self.kv_dtype = storage  # the pages': ``dtype``, or a quantised format
        self.step: StepPlan | PackedPlan | None = None
        self._written: set[int] = set()  # layers already written in this step
        # transformers' view: the page-table rows its batch index refers to, and how many
        # positions (padding included) its forwards have fed along the time axis.
        self.batch_rows: list[int] = []
        self.seen_tokens = 0

    # ------------------------------------------------------------------ steps
    def begin_step(self, rows: Sequence[int], new_tokens: Sequence[int], q_len: int | None = None) -> StepPlan:
        """Reserve room for ``new_tokens[b]`` tokens in each row and plan where they go.

        All or nothing: on ``OutOfPagesError`` no page, length or K/V byte has changed.
        """
        if self.windowed:
            raise ValueError("a cache whose windowed layers keep window rows takes packed steps (begin_packed_step)")
        self.reserve(rows, new_tokens)
        self.step = self.page_table.plan(rows, new_tokens, q_len)
        return self.step

    def begin_packed_step(
        self,
        decode_rows: Sequence[int],
        chunks: Sequence[tuple[int, int]],
        decode_len: int,
        chunk_len: int,
        chunk_block: int = 16,
        pad_decode: bool = False,
        into: PackedPlan | None = None,
        reserved: bool = False,
    ) -> PackedPlan:
        """Reserve room for a ragged step (``reserve``; not if its tokens are ``reserved`` already, as
        the Engine's are when it schedules them) and plan it: each of ``decode_rows`` feeds its last
        token (a row listed ``m`` times its last ``m``), each ``(row, num_tokens)`` prefill chunk its
        last ``num_tokens``, packed as
        ``PageTable.plan_packed`` describes (``into``: rewriting a static plan's tensors). All or
        nothing, as ``begin_step``."""
        check_packed_layout(len(decode_rows), [n for _, n in chunks], decode_len, chunk_len, chunk_block)
        if not reserved:
            fed = Counter(decode_rows)
            self.reserve([*fed, *(row for row, _ in chunks)], [*fed.values(), *(n for _, n in chunks)])
        self.step = self.page_table.plan_packed(decode_rows, chunks, decode_len, chunk_len, chunk_block, pad_decode,
                                                into)
        self._written = set()
        return self.step

    def learn_window(self, mask: PackedBlockMask) -> None:
        """After a forward through ``mask``: if every layer attended through a sliding window, rows
        give back their pages before the widest window from now on (``PageTable.window``)."""
        if self.page_table.window is not None:
            return
        windows = mask.windows()
        if windows and None not in windows:
            self.page_table.window = max(windows)

    def reserve(self, rows: Sequence[int], new_tokens: Sequence[int]) -> None:
        """Grow each row by its new tokens (pages allocated, shared last pages copied before they
        are written). All or nothing: on ``OutOfPagesError`` no page, length or K/V byte has changed."""
        copies = self.page_table.extend(rows, new_tokens)  # ValueError for an unused row
        for src, dst in copies:
            for layer in self.pool_layers:
                layer.copy_page(src, dst, self.page_size)
        self._written = set()

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's K/V for one layer; return that layer's full pools.

        ``key_states``/``value_states`` are ``[B, kv_heads, q, head_dim]`` with ``q`` at most
        the plan's ``q_len`` (a forward may be shorter than its bucketed plan: its tokens are
        the plan's last ``q`` columns). Each layer is written once per step.
        """
        step = self.step
        if step is None or layer_idx in self._written:
            raise RuntimeError(
                "PagedKVCache.update outside a paged step: no step was begun for this forward "
                "(use a model wrapped with flexpage.wrap, or call begin_step first)"
            )
        layer = self.layers[layer_idx]
        q = key_states.shape[2] if key_states.dim() == 4 else -1
        batch = step.slots.shape[0]
        expected = (batch, self.num_kv_heads, q, self.head_dim)
        if (
            tuple(key_states.shape) != expected
            or tuple(value_states.shape) != expected
            or not step.max_new <= q <= step.q_len
        ):
            raise ValueError(
                f"key/value states must have shape (batch={batch}, kv_heads={self.num_kv_heads}, "
                f"q in [{step.max_new}, {step.q_len}], head_dim={self.head_dim}), "
                f"got {tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        slots = step.window_plan.slots if layer_idx in self.windowed else step.slots
        layer.write(slots[:, step.q_len - q :], key_states, value_states)
        self._written.add(layer_idx)
        return layer.keys, layer.values

    # ------------------------------------------------------------------ transformers Cache API
    def begin_batch_step(self, new_tokens: Sequence[int], positions: int, shape: StepShape) -> PackedPlan:
        """A step of a transformers forward of ``positions`` columns, packed: batch index ``b`` is row
        ``batch_rows[b]``, whose last ``new_tokens[b]`` columns are its tokens (left padding is never
        stored). One column is a decode step (each row a decode token), more are prefill chunks (each
        row's tokens a chunk), laid out as ``shape`` says. The first step of a batch claims its rows;
        ``positions`` is what ``get_seq_length`` advances by. All or nothing, as ``begin_step``."""
        if self.batch_rows and len(self.batch_rows) != len(new_tokens):
            raise ValueError(f"batch of {len(new_tokens)} rows, but this cache holds a batch of {len(self.batch_rows)}")
        claimed: list[int] = []
        try:
            if not self.batch_rows:
                for _ in new_tokens:
                    claimed.append(self.add_sequence())
            rows = claimed or self.batch_rows
            decode = rows if positions == 1 else []
            chunks = [] if positions == 1 else [(row, n) for row, n in zip(rows, new_tokens) if n]
            plan = self.begin_packed_step(decode, chunks, shape.decode_len(len(decode)),
                                          shape.chunk_len(n for _, n in chunks), shape.chunk_block)
        except Exception:
            for row in claimed:  # rows this call claimed go back; earlier state is untouched
                self.free_sequence(row)
            raise
        if claimed:
            self.batch_rows = claimed
        self.seen_tokens += positions
        return plan

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.page_table.max_pages_per_seq * self.page_size

    @property
    def max_batch_size(self) -> int:
        return self.page_table.max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self.get_max_length()

    def reset(self) -> None:
        """Release every sequence (pages back to the pool); the pools stay allocated."""
        for row in self.page_table.active_rows:
            self.free_sequence(row)
        self.batch_rows, self.seen_tokens, self.step = [], 0, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: batch row ``i`` takes what row ``beam_idx[i]`` held, by page references."""
        sources = [self.batch_rows[i] for i in beam_idx.tolist()]
        self.page_table.permute(self.batch_rows, sources)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every sequence (transformers' convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        for row in self.batch_rows:
            self.page_table.truncate(row, max(0, self.page_table.seq_lens[row] + tokens_to_remove))
        self.seen_tokens = max(0, self.seen_tokens + tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence becomes ``repeats`` sequences sharing its pages."""
        new_rows = []
        for row in self.batch_rows:
            new_rows += [row] + [self.fork(row) for _ in range(repeats - 1)]
        self.batch_rows = new_rows

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        keep = [self.batch_rows[i] for i in indices.tolist()]
        for row in set(self.batch_rows) - set(keep):
            self.free_sequence(row)
        self.batch_rows = keep

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, row: int | None = None) -> int:
        return self.page_table.add_sequence(row)

    def free_sequence(self, row: int) -> None:
        self.page_table.free_sequence(row)

    def fork(self, src: int, dst: int | None = None) -> int:
        return self.page_table.fork(src, dst)

    def seq_length(self, row: int) -> int:
        self.page_table.pages_of(row)
        return self.page_table.seq_lens[row]

    def gather(self, layer_idx: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's K/V as contiguous ``[kv_heads, length, head_dim]`` tensors of the model's dtype
        (dequantised from quantised pages), for tests and export."""
        length = self.seq_length(row)
        held = self.layer_row(layer_idx, row)
        if self.page_table.first_held[held]:
            raise ValueError(f"row {row} gave back the pages before its sliding window: its K/V are not all held")
        layer = self.layers[layer_idx]
        slots = self.page_table.slots_of(self.page_table.seq_pages[held])[:length].to(layer.device)
        if self.kv_dtype == self.dtype:
            return layer.keys[0, :, slots], layer.values[0, :, slots]
        return dequantise(layer.keys[0, :, slots], self.dtype), dequantise(layer.values[0, :, slots], self.dtype)

    def layer_row(self, layer_idx: int, row: int) -> int:
        """The page-table row holding layer ``layer_idx``'s K/V of ``row``: its window row for a windowed
        layer where the cache keeps them apart, else ``row``."""
        return self.page_table.window_row(row) if layer_idx in self.windowed else row

    @property
    def pool_layers(self) -> list[PagedLayer]:
        """The layers whose pools are their own (a windowed layer may share a global layer's)."""
        return [layer for i, layer in enumerate(self.layers)
                if all(layer.keys is not other.keys for other in self.layers[:i])]

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes one slot takes over every pool's K and V (scales included): what a token takes
        (a token within its window takes a slot of its window row too, where those are kept)."""
        return sum(2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size()
                   for layer in self.pool_layers)

    def stats(self) -> CacheStats:
        """Pages in use and live tokens (shared pages counted once), from counts the page table
        keeps as it changes: O(1) whatever the number of rows and pages."""
        pt = self.page_table
        used = pt.num_pages - pt.num_free_pages
        reserved = used * self.page_size
        return CacheStats(
            pages_total=pt.num_pages,
            pages_used=used,
            pages_free=pt.num_free_pages,
            live_tokens=pt.live_tokens,
            reserved_slots=reserved,
            utilisation=pt.live_tokens / reserved if reserved else 1.0,
            pages_cached=len(pt.cached_pages),
        )
