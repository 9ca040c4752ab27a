"""HuggingFace integration: ``wrap(model)`` routes ``generate()`` through a PagedKVCache.

Only transformers' own extension points are used, and only on the model given:

* the attention implementation ``"flexpage"`` (``"flexpage_eager"`` for models whose stock
  path is eager) is registered with ``AttentionInterface`` / ``AttentionMaskInterface``;
  when a forward carries no paged cache both hooks defer to the stock implementation, so
  scoring or training a wrapped model computes exactly what it did before;
* a paged step begins before each forward whose cache is a ``PagedKVCache``: its pages are
  reserved and its ``[batch, columns]`` tokens planned as the Engine's steps are, packed into one
  row (decode tokens as decode rows, each prompt a chunk; left padding dropped), with the one
  ``PackedBlockMask`` every layer gets as its attention mask. In ``generate`` it begins in
  ``prepare_inputs_for_generation`` (so the forward itself, compiled or not, does no host-side
  bookkeeping), in direct forward calls in a forward pre-hook on the model's decoder, which packs
  the decoder's inputs; a forward hook lays its hidden states back out as ``[batch, columns]``
  (``nn.Module`` hooks on that instance);
* ``generate`` and ``prepare_inputs_for_generation`` are shadowed on the instance only.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .core.attention import packed_attention
from .core.cache import PagedKVCache, pages_for_tokens
from .core.host import cdiv, host_tensor
from .core.linear import FewRowLinears
from .core.masks import PackedBlockMask
from .core.pages import PackedPlan, PageTable
from .core.policy import device_policy
from .core.static_step import StaticSteps, compiles_by_default
from .core.step_shape import StepShape
from .errors import UnsupportedModelError

FALLBACKS = {"sdpa": "flexpage", "eager": "flexpage_eager"}  # stock implementation -> our name
# wrap's page size when none is given is the device policy's; a pool smaller than that gets pages of 16
# tokens, FlexAttention's smallest CUDA tile
MIN_PAGE_SIZE = 16
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Config flags whose attention flexpage does not reproduce (attribute -> what it means).
UNSUPPORTED_FLAGS = {
    "attention_chunk_size": "chunked local attention",
    "use_bidirectional_attention": "bidirectional attention",
    "sliding_window_pattern_bidirectional": "bidirectional sliding attention",
}


@dataclass
class PagedState:
    """What ``wrap`` keeps on a model (``paged_state(model)``): its paged cache, the stock settings
    ``unwrap`` restores, the step hooks, the forward's name for the cache, the CPU linear kernels,
    the static steps."""

    cache: PagedKVCache
    stock_implementation: str
    hooks: tuple[RemovableHandle, RemovableHandle]  # the decoder's step hooks: begin (and pack), unpack
    cache_argument: str  # the forward's name for the KV cache (``cache_argument(model)``)
    linears: FewRowLinears | None
    steps: StaticSteps | None  # the compiled static decode steps (``compile_decode``)
    shape: StepShape  # how its steps are packed


def wrap(
    model: PreTrainedModel,
    page_size: int | None = None,
    max_cached_tokens: int = 32768,
    max_batch_size: int = 32,
    max_seq_len: int | None = None,
    compile_decode: bool | None = False,
    few_row_linears: bool = True,
    pack_weights: bool | None = False,
    kv_dtype: str | torch.dtype | None = None,
) -> PreTrainedModel:
    """Serve ``model.generate()`` from a paged KV cache of ``max_cached_tokens`` tokens.

    The cache is allocated once (per-layer pools on each layer's device, in the model's
    dtype) and reused by every ``generate`` call; a call's pages are released when it
    returns. Where some layers attend a sliding window and the others every position (Gemma 2),
    the pool takes the bytes of ``max_cached_tokens`` tokens in every layer and holds more tokens
    (``PagedKVCache``'s window rows, ``pages_for_tokens``). ``max_seq_len`` caps one sequence
    (default: the whole pool). Returns the same model object. Raises ``UnsupportedModelError`` for
    models flexpage cannot serve exactly.
    ``page_size`` (tokens per page) defaults to 64 when every layer runs on the CPU (where
    attention over many sequences runs faster over fewer, larger KV blocks) and the pool holds a
    page of 64, else 16.

    ``compile_decode=True`` runs ``generate``'s decode steps (one new token per sequence) as static
    steps compiled per batch bucket, exactly as the Engine's (``flexpage.static_step``): each bucket
    is compiled on its first step (ahead of time, saved: a later process loads it in about a
    second), its inputs written in place, its linear layers and attention the eager path's kernels.
    ``None`` compiles where the device policy measured it faster (the CPU), ``False`` (the default:
    a ``generate`` call never waits on a compile) nowhere. Greedy tokens match the stock model's
    (logits within float rounding of eager's).

    ``few_row_linears`` (the default) lets the linear layers of paged forwards on the CPU, when
    they get 1-65536 rows, take whichever of MKL's ``x @ W.T``, MKL's ``(W @ x.T).T``, oneDNN's
    matmul and (bfloat16 on AVX512-BF16 cores) flexpage's few-row kernel measured fastest for that
    weight shape and row count on this CPU (``flexpage.core.linear``;
    last-bit differences, as paged attention has); the model's plain forwards are untouched. With
    ``compile_decode`` the kernels are timed when wrapping (each weight shape at 1 to
    ``max_batch_size`` rows, a second or two), since a compiled step bakes its kernels in.
    ``pack_weights`` adds oneDNN on a copy of each weight in its blocked layout, laid out for
    ``max_batch_size`` rows, to those kernels: decode steps of many sequences get faster, for a
    second copy of the CPU layers' weights in memory. ``None`` packs when oneDNN is there and the copy needs at
    most a quarter of the memory available (``FewRowLinears.packing_fits``): the Engine's default.

    ``kv_dtype`` stores the pages in the model's dtype (``None``, the default) or quantised:
    ``"int8"`` or ``"float8_e4m3fn"`` (``"fp8"``), with a scale per token and KV head
    (``flexpage.core.quant``): about a quarter of float32's bytes per token, for attention over
    values within the format's rounding (greedy tokens may then differ from stock's).
    """
    if pack_weights and not few_row_linears:
        raise ValueError("pack_weights=True needs few_row_linears=True (packed weights are one of its kernels)")
    if getattr(model, "_flexpage", None) is not None:
        unwrap(model)
    stock = check_supported(model)
    devices = _layer_devices(model)
    if page_size is None:  # a pool smaller than one CPU page keeps 16-token pages
        page_size = min(device_policy(device).page_size for device in devices)
        page_size = page_size if max_cached_tokens >= page_size else MIN_PAGE_SIZE
    if max_cached_tokens < page_size:
        raise ValueError(f"max_cached_tokens ({max_cached_tokens}) must hold at least one page of {page_size}")
    num_pages = pages_for_tokens(model.config, max_cached_tokens, page_size)  # (more where windowed layers share pools)
    cache = PagedKVCache(
        model.config,
        page_size=page_size,
        num_pages=num_pages,
        max_batch_size=max_batch_size,
        max_pages_per_seq=min(num_pages, cdiv(max_seq_len, page_size)) if max_seq_len else None,
        dtype=model.dtype,
        device=devices,
        num_kv_heads=kv_heads_per_rank(model),
        kv_dtype=kv_dtype,
    )
    _register(stock)
    model.set_attn_implementation(FALLBACKS[stock])
    shape = StepShape.of(model, devices[0], cache.layers[0].keys.dtype, cache.num_kv_heads, cache.head_dim)
    hooks = (model.base_model.register_forward_pre_hook(functools.partial(_begin_paged_step, shape), with_kwargs=True),
             model.base_model.register_forward_hook(_end_paged_step, with_kwargs=True))
    linears = FewRowLinears(model, _is_paged_call) if few_row_linears else None
    if linears is not None and (pack_weights or pack_weights is None and linears.packing_fits()):
        linears.pack(max_batch_size)
    steps = None
    if compile_decode or compile_decode is None and compiles_by_default(model, devices[0]):
        steps = StaticSteps(model, cache, cache_argument(model), linears,
                            {shape.decode_len(n) for n in range(1, max_batch_size + 1)}, shape)
    model._flexpage = PagedState(cache, stock, hooks, cache_argument(model), linears, steps, shape)
    if steps is not None:
        steps.learn_alone()  # the layers' attention variants, which a static step builds first
        model.forward = _shadowed_forward(model)
    model.generate = types.MethodType(_paged_generate, model)
    model.prepare_inputs_for_generation = types.MethodType(_paged_prepare_inputs, model)
    return model


def paged_state(model: PreTrainedModel) -> PagedState | None:
    """The state ``wrap`` gave ``model`` (its ``cache``, ``cache_argument``, ``linears``), or None if
    it is not wrapped."""
    return getattr(model, "_flexpage", None)


def unwrap(model: PreTrainedModel) -> PreTrainedModel:
    """Undo ``wrap``: stock attention, stock ``generate``, the cache released."""
    state = paged_state(model)
    if state is None:
        return model
    for hook in state.hooks:
        hook.remove()
    if state.linears is not None:
        state.linears.remove()
    model.set_attn_implementation(state.stock_implementation)
    del model.generate, model.prepare_inputs_for_generation  # the class's methods show through again
    if state.steps is not None:
        del model.forward
    model._flexpage = None
    return model


def check_supported(model: PreTrainedModel) -> str:
    """The stock attention implementation flexpage stands in for; raises UnsupportedModelError."""
    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: encoder-decoder models are not supported (decoder-only only)")
    if not hasattr(model, "generate") or not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(f"{name}: its attention does not go through transformers' AttentionInterface")
    for flag, meaning in UNSUPPORTED_FLAGS.items():
        if getattr(config, flag, None):
            raise UnsupportedModelError(f"{name}: config.{flag}={getattr(config, flag)!r} ({meaning}) is not supported")
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - SUPPORTED_LAYER_TYPES:
        raise UnsupportedModelError(f"{name}: layer types {sorted(layer_types - SUPPORTED_LAYER_TYPES)} are not supported")
    stock = config._attn_implementation
    if stock not in FALLBACKS:
        raise UnsupportedModelError(
            f"{name}: wrap a model loaded with attn_implementation 'sdpa' or 'eager' (it has {stock!r})"
        )
    return stock


def kv_heads_per_rank(model: PreTrainedModel) -> int:
    """The KV heads this process's attention sees: all of them, or ``1/tp`` of them on each rank
    of a model loaded with transformers' tensor parallelism (``DistributedConfig(tp_size=...)``)."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    tp = getattr(model, "tp_size", None) or 1
    if heads % tp or config.num_attention_heads % tp:
        raise UnsupportedModelError(
            f"{type(model).__name__}: {config.num_attention_heads} query / {heads} KV heads do not split evenly "
            f"over tensor-parallel size {tp}"
        )
    return heads // tp


def _layer_devices(model: PreTrainedModel) -> list[torch.device]:
    """The device each decoder layer's attention runs on: models dispatched with a device_map
    span several, and a layer offloaded by accelerate (its weights on the CPU, or on disk with
    parameters on ``meta``) runs on its hook's execution device."""
    devices: dict[int, torch.device] = {}
    for module in model.modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int) and type(module).__name__.endswith("Attention") and layer_idx not in devices:
            param = next(module.parameters(), None)
            devices[layer_idx] = _execution_device(module) or (param.device if param is not None else model.device)
    count = model.config.num_hidden_layers
    return [devices.get(i, model.device) for i in range(count)]


def _execution_device(module: torch.nn.Module) -> torch.device | None:
    """Where accelerate's hooks run ``module`` (None when it is not dispatched by accelerate)."""
    for sub in module.modules():
        hook = getattr(sub, "_hf_hook", None)
        for h in getattr(hook, "hooks", [hook]):  # a SequentialHook holds several
            device = getattr(h, "execution_device", None)
            if device is not None:
                return torch.device(device)
    return None


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model``'s forward takes its KV cache: ``cache`` from transformers
    5.24 on, ``past_key_values`` before (and in models that kept the old name)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _paged_generate(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    """``generate`` on a wrapped model: uses the model's PagedKVCache unless given a cache. Its
    pages are given back when generate returns, unless the output hands the cache to the caller
    (``return_dict_in_generate``, as an assistant model's drafts do, to continue from it); the
    next call without a cache starts it afresh."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None or kwargs.get("use_cache") is False:
        return type(self).generate(self, *args, **kwargs)
    cache = self._flexpage.cache
    cache.reset()
    config = kwargs.get("generation_config") or self.generation_config
    handed_back = kwargs.get("return_dict_in_generate", config.return_dict_in_generate)
    try:
        output = type(self).generate(self, *args, **{self._flexpage.cache_argument: cache}, **kwargs)
    except BaseException:
        cache.reset()
        raise
    if not handed_back:
        cache.reset()
    return output


def new_token_counts(attention_mask: torch.Tensor | None, batch: int, q_len: int) -> list[int]:
    """Real (non-padding) tokens per row among a forward's ``q_len`` new positions.

    transformers pads batched prompts on the left; padding is never stored in pages, so a
    padding position after a real token (right padding) cannot be served and is rejected.
    """
    if attention_mask is None or q_len == 1:  # a decode step feeds one real token per row
        return [q_len] * batch
    if attention_mask.dim() != 2:
        raise ValueError(f"a paged forward takes a 2-D padding mask, got shape {tuple(attention_mask.shape)}")
    tail = attention_mask[:, -q_len:].to(device="cpu", dtype=torch.bool)
    counts = tail.sum(-1)
    left_padded = torch.arange(q_len) >= (q_len - counts)[:, None]
    if not torch.equal(tail, left_padded):
        raise ValueError("flexpage needs left padding (padding_side='left'): a padding position follows a token")
    return counts.tolist()


class BatchStepMask(PackedBlockMask):
    """The packed mask of a transformers forward over a ``[batch, columns]`` batch, and where its
    tokens sit: packed position ``sources[i]`` is flat batch position ``targets[i]`` (None for
    both: the packed row is the batch itself, as in every decode step)."""

    batch_shape: tuple[int, int]
    sources: torch.Tensor | None
    targets: torch.Tensor | None
    gather: torch.Tensor | None  # [packed positions] the flat batch position each packs (padding: 0)

    @classmethod
    def for_batch(cls, page_table: PageTable, plan: PackedPlan, counts: list[int], columns: int) -> "BatchStepMask":
        """The mask of ``plan``, a step of ``len(counts)`` rows whose last ``counts[b]`` of ``columns``
        positions are tokens (``PagedKVCache.begin_batch_step``)."""
        mask = cls.for_step(page_table, plan)
        mask.batch_shape = (len(counts), columns)
        sources, targets, at = [], [], plan.decode_tokens
        for b, n in enumerate(counts) if plan.chunks else ():
            sources += range(at, at + n)
            targets += range((b + 1) * columns - n, (b + 1) * columns)
            at += cdiv(n, plan.chunk_block) * plan.chunk_block
        mask.sources = mask.targets = mask.gather = None
        packed_as_is = sources == targets == list(range(plan.q_len)) and plan.q_len == len(counts) * columns
        if plan.chunks and not packed_as_is:  # padding to drop, or chunks aligned past it
            gather = [0] * plan.q_len
            for source, target in zip(sources, targets):
                gather[source] = target
            device = plan.position_ids.device
            mask.sources, mask.targets = host_tensor(sources, device), host_tensor(targets, device)
            mask.gather = host_tensor(gather, device)
        return mask

    def pack(self, batch: torch.Tensor) -> torch.Tensor:
        """``[batch, columns, ...]`` inputs as the packed row ``[1, positions, ...]``."""
        flat = batch.reshape(-1, *batch.shape[2:])
        return (flat if self.gather is None else flat[self.gather])[None]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """The packed row's ``[1, positions, ...]`` outputs as ``[batch, columns, ...]`` (zeros at padding)."""
        if self.targets is None:
            return packed.view(*self.batch_shape, *packed.shape[2:])
        out = packed.new_zeros(self.batch_shape[0] * self.batch_shape[1], *packed.shape[2:])
        out.index_copy_(0, self.targets, packed[0].index_select(0, self.sources))
        return out.view(*self.batch_shape, *packed.shape[2:])


def paged_step_mask(cache: PagedKVCache, inputs: torch.Tensor, attention_mask: torch.Tensor | None,
                    shape: StepShape) -> BatchStepMask:
    """Begin a forward's paged step (reserve pages, plan the packed step) and build its mask."""
    batch, columns = inputs.shape[:2]
    counts = new_token_counts(attention_mask, batch, columns)
    plan = cache.begin_batch_step(counts, columns, shape)
    return BatchStepMask.for_batch(cache.page_table, plan, counts, columns)


def _paged_cache(kwargs: dict) -> PagedKVCache | None:
    """The PagedKVCache a forward's keyword arguments carry (under either name), if any."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, PagedKVCache) else None


def _is_paged_call(kwargs: dict) -> bool:
    return _paged_cache(kwargs) is not None


def _begin_paged_step(shape: StepShape, module: torch.nn.Module, args: tuple, kwargs: dict
                      ) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the decoder: a forward whose cache is a PagedKVCache runs paged, its
    ``[batch, columns]`` inputs packed into the step's one row."""
    cache, mask = _paged_cache(kwargs), kwargs.get("attention_mask")
    if cache is None or isinstance(mask, PackedBlockMask) and not isinstance(mask, BatchStepMask):
        return None  # not a paged call (the stock path runs untouched), or an Engine's step, packed already
    name = next((key for key in ("input_ids", "inputs_embeds") if kwargs.get(key) is not None), None)
    inputs = kwargs[name] if name else args[0]  # given by name, or the first positional argument
    if not isinstance(mask, BatchStepMask):  # a direct call: the step begins here
        mask = kwargs["attention_mask"] = paged_step_mask(cache, inputs, mask, shape)
    positions = kwargs.get("position_ids")
    if positions is None:  # transformers' Cache contract: positions follow the cached length (the plan's)
        kwargs["position_ids"] = mask.plan.position_ids
    else:
        batch = mask.batch_shape  # position ids may be given once for every row ([1, columns])
        kwargs["position_ids"] = (mask.pack(positions.expand(batch)) if positions.dim() == 2  # multimodal rotary: 3-D
                                  else torch.stack([mask.pack(p.expand(batch)) for p in positions]))
    if name:
        kwargs[name] = mask.pack(inputs)
    else:
        args = (mask.pack(inputs), *args[1:])
    return args, kwargs


def _end_paged_step(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook of the decoder: a paged forward's hidden states laid back out as ``[batch, columns]``
    (and the cache told the windows its layers attended, ``PagedKVCache.learn_window``)."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, BatchStepMask):
        return None
    _paged_cache(kwargs).learn_window(mask)
    if isinstance(output, tuple):
        return (mask.unpack(output[0]), *output[1:])
    output.last_hidden_state = mask.unpack(output.last_hidden_state)
    if getattr(output, "hidden_states", None) is not None:
        output.hidden_states = tuple(mask.unpack(hidden) for hidden in output.hidden_states)
    return output


def _paged_prepare_inputs(self: PreTrainedModel, *args: Any, **kwargs: Any) -> dict:
    """``prepare_inputs_for_generation`` on a wrapped model: the step begins here, before the
    forward, so a compiled decode forward contains no host-side page bookkeeping."""
    inputs = type(self).prepare_inputs_for_generation(self, *args, **kwargs)
    cache = _paged_cache(inputs)
    if cache is not None:
        tokens = inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs.get("inputs_embeds")
        # the generation-level 2-D padding mask (transformers may have expanded the forward's to 4-D)
        inputs["attention_mask"] = paged_step_mask(cache, tokens, kwargs.get("attention_mask"), self._flexpage.shape)
    return inputs


def _shadowed_forward(model: PreTrainedModel) -> Any:
    """``_paged_forward`` bound to ``model``, with its class forward's signature (``generate`` checks
    its arguments against it): a new function per model, so no model's signature leaks to another's."""

    @functools.wraps(type(model).forward)
    def forward(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        return _paged_forward(self, *args, **kwargs)

    return types.MethodType(forward, model)


def _paged_forward(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
    """``forward`` on a model wrapped with ``compile_decode``: a decode step of ``generate`` (its paged step
    begun, one new token per sequence), or a direct call feeding one token per sequence over the wrapped
    cache (its step begun here), runs its bucket's static step when that is compiled; every other
    forward is the class's."""
    state, mask = self._flexpage, kwargs.get("attention_mask")
    ids = kwargs.get("input_ids")
    if (not args and mask is None and kwargs.get("position_ids") is None and _paged_cache(kwargs) is state.cache
            and ids is not None and ids.dim() == 2 and ids.shape[1] == 1):
        mask = kwargs["attention_mask"] = paged_step_mask(state.cache, ids, None, state.shape)
    plain = args or not isinstance(mask, BatchStepMask) or mask.plan.chunks or kwargs.get("input_ids") is None
    if plain or kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return type(self).forward(self, *args, **kwargs)
    rows = list(mask.plan.decode_rows)
    decode_len = state.steps.bucket(len(rows))
    if not state.steps.ready(decode_len):
        return type(self).forward(self, *args, **kwargs)
    logits, _ = state.steps.run(rows, kwargs["input_ids"][:, -1].tolist(), decode_len)
    return CausalLMOutputWithPast(logits=logits[: len(rows), None], **{state.cache_argument: state.cache})


def _make_attention(stock: str):
    def flexpage_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if not isinstance(attention_mask, PackedBlockMask):
            fallback = ALL_ATTENTION_FUNCTIONS.get(stock) or sys.modules[type(module).__module__].eager_attention_forward
            return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if dropout:
            raise UnsupportedModelError(f"{type(module).__name__}: attention dropout (training mode) in a paged call")
        for name in ("s_aux", "sinks"):
            if kwargs.get(name) is not None:
                raise UnsupportedModelError(f"{type(module).__name__}: attention sinks ({name}) are not supported")
        out = packed_attention(query, key, value, attention_mask, kwargs.get("sliding_window"), kwargs.get("softcap"),
                               scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return flexpage_attention


def _make_mask(stock: str):
    def flexpage_mask(*args: Any, **kwargs: Any):
        # Paged forwards arrive with a ready PackedBlockMask and never get here.
        return ALL_MASK_ATTENTION_FUNCTIONS[stock](*args, **kwargs)

    return flexpage_mask


def _register(stock: str) -> None:
    name = FALLBACKS[stock]
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention(stock))
        AttentionMaskInterface.register(name, _make_mask(stock))
