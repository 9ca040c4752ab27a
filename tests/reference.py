"""Shared test helpers: fill a paged cache from contiguous tensors, reference attention, stock
``generate()`` (greedy, with the logit penalties and bias a request may ask for, and the
distribution its sampling warpers leave), the tiny Engine the engine tests share, and a model-free
BlockManager with a snapshot of its page table for the scheduler's unit tests."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import flexpage
from flexpage import mods, zoo
from flexpage.core import quant
from flexpage.engine.block_manager import BlockManager
from flexpage.engine.sampling import sample_tokens

GARBAGE = 1e4  # what unwritten slots hold: any read of one shows up as a huge error


def make_cache(page_size, num_pages, num_kv_heads, head_dim, dtype=torch.float32, max_batch_size=8, seed=0,
               device="cpu", kv_dtype=None):
    """A one-layer cache whose free list is shuffled, so pages land scattered over the pool, and
    whose unwritten slots hold ``GARBAGE`` (quantised pools: ``GARBAGE`` quantised)."""
    cache = flexpage.PagedKVCache(
        num_layers=1,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        num_pages=num_pages,
        max_batch_size=max_batch_size,
        dtype=dtype,
        device=device,
        kv_dtype=kv_dtype,
    )
    free = list(cache.page_table.free_pages)
    random.Random(seed).shuffle(free)
    cache.page_table.free_pages.clear()
    cache.page_table.free_pages.extend(free)
    for pool in (cache.layers[0].keys, cache.layers[0].values):
        garbage = torch.full((*pool.shape[:-1], head_dim), GARBAGE)
        pool.copy_(quant.quantise(garbage, pool.dtype) if quant.is_quantised(pool) else garbage)
    return cache


def rounded(states, kv_dtype):
    """``states`` as quantised pages of ``kv_dtype`` (a name or dtype) give them back (``flexpage.core.quant``)."""
    return quant.dequantise(quant.quantise(states, quant.KV_DTYPES.get(kv_dtype, kv_dtype)), states.dtype)


class RoundedKVCache(DynamicCache):
    """Stock's dynamic cache storing K/V as quantised pages of ``kv_dtype`` give them back: the
    reference for attention over quantised pages (each token's K/V rounded once, when written)."""

    def __init__(self, kv_dtype, **kwargs):
        super().__init__(**kwargs)
        self.kv_dtype = kv_dtype

    def update(self, key_states, value_states, *args, **kwargs):
        return super().update(rounded(key_states, self.kv_dtype), rounded(value_states, self.kv_dtype), *args,
                              **kwargs)


def write_step(cache, rows, keys, values, q_len=None):
    """Append ``keys[b]``/``values[b]`` (``[Hkv, n_b, D]``) to each row in one left-padded step."""
    counts = [k.shape[1] for k in keys]
    plan = cache.begin_step(rows, counts, q_len)
    batch, hkv, d = len(rows), keys[0].shape[0], keys[0].shape[2]
    k = torch.zeros(batch, hkv, plan.q_len, d, dtype=cache.dtype, device=cache.layers[0].keys.device)
    v = torch.zeros_like(k)
    for b, n in enumerate(counts):
        if n:
            k[b, :, plan.q_len - n :] = keys[b].to(k.device)
            v[b, :, plan.q_len - n :] = values[b].to(v.device)
    pools = cache.update(k, v, 0)
    return plan, pools


def dense_mask(mask_mod, b, num_heads, q_pos, kv_len):
    """``[H, Q, L]`` boolean mask of a logical mask_mod (default causal) for one row."""
    mask_mod = mods.causal if mask_mod is None else mask_mod
    h = torch.arange(num_heads)[:, None, None]
    q = q_pos[None, :, None]
    kv = torch.arange(kv_len)[None, None, :]
    return mask_mod(torch.tensor(b), h, q, kv).expand(num_heads, len(q_pos), kv_len)


def reference_attention(q, k, v, q_pos, b, mask_mod=None, score_mod=None, scale=None):
    """Attention of one row's queries ``[Hq, Q, D]`` over its contiguous ``k``/``v`` ``[Hkv, L, D]``.

    Masks (and ALiBi, an additive bias) go through ``F.scaled_dot_product_attention``; a
    non-additive score_mod (soft-capping) through an explicit float64 softmax.
    """
    hq, hkv = q.shape[0], k.shape[0]
    mask = dense_mask(mask_mod, b, hq, q_pos, k.shape[1])
    qf, kf, vf = q.double(), k.double(), v.double()
    kf, vf = kf.repeat_interleave(hq // hkv, 0), vf.repeat_interleave(hq // hkv, 0)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if score_mod is None or getattr(score_mod, "additive", False):
        bias = torch.zeros(mask.shape, dtype=torch.float64)
        if score_mod is not None:
            h = torch.arange(hq)[:, None, None]
            bias = score_mod(bias, torch.tensor(b), h, q_pos[None, :, None], torch.arange(k.shape[1])[None, None])
        bias = bias.masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=bias, scale=scale)
    scores = qf @ kf.transpose(-1, -2) * scale
    h = torch.arange(hq)[:, None, None]
    scores = score_mod(scores, torch.tensor(b), h, q_pos[None, :, None], torch.arange(k.shape[1])[None, None])
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vf


class OpenAIPenalties(LogitsProcessor):
    """The reference for OpenAI's presence and frequency penalties, as its API documents them: each
    token in the output so far (not the prompt) loses ``presence`` once and ``frequency`` per
    occurrence."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[0, self.prompt_len :].tolist()
        for token in set(output):
            scores[0, token] -= self.presence + self.frequency * output.count(token)
        return scores


def stock_adjusted(model, prompt, new_tokens, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                   logit_bias=None, min_new_tokens=0, eos_token_id=None):
    """Stock greedy ``generate()`` with the penalties, bias and minimum length: transformers' own
    processors for the repetition penalty, the bias (``sequence_bias`` of one-token sequences) and
    ``min_new_tokens``, the reference above for presence and frequency (a custom processor runs
    after transformers' own); no stop token unless ``eos_token_id`` names one."""
    extra = [OpenAIPenalties(len(prompt), presence_penalty, frequency_penalty)]
    bias = {(token,): value for token, value in (logit_bias or {}).items()} or None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         eos_token_id=eos_token_id, repetition_penalty=repetition_penalty, sequence_bias=bias,
                         min_new_tokens=min_new_tokens, logits_processor=LogitsProcessorList(extra))
    return out[0, len(prompt) :].tolist()


VOCAB = 256  # the tiny configs' vocabulary
LENGTHS = (5, 37, 130, 64, 17, 200, 3, 90)
NEW_TOKENS = (12, 5, 20, 9, 30, 7, 15, 11)


def workload(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def stock_greedy(model, prompt, new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def make_blocks(num_pages=16, max_batch_size=4, prefix_caching=True):
    """A BlockManager over a one-layer pool of 16-token pages: scheduling needs no model."""
    cache = flexpage.PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=16, page_size=16, num_pages=num_pages,
                                  max_batch_size=max_batch_size)
    return BlockManager(cache, prefix_caching)


def page_state(blocks):
    """What reserving, rolling back or warming up may change in the page table (the free list's order aside)."""
    pt = blocks.cache.page_table
    return dict(lens=list(pt.seq_lens), pages=[None if p is None else list(p) for p in pt.seq_pages],
                refs=list(pt.ref_counts), free=sorted(pt.free_pages), cached=list(pt.cached_pages),
                keys=dict(pt.key_pages), live=pt.live_tokens, table=pt.table.tolist(), mirror=pt.lens.tolist(),
                logical=pt.page_logical.tolist())


def make_engine(arch="llama", **kwargs):
    options = dict(page_size=16, max_cached_tokens=2048, max_batch_size=8, max_tokens_per_step=128) | kwargs
    return flexpage.Engine(zoo.build(f"{arch}-tiny"), **options)


def warped_probs(logits, temperature, top_k, top_p):
    """The reference: the distribution ``generate()`` samples from, one row at a time."""
    rows = []
    for row, t, k, p in zip(logits, temperature, top_k, top_p):
        warpers = LogitsProcessorList([TemperatureLogitsWarper(t)] if t != 1.0 else [])
        if k is not None:
            warpers.append(TopKLogitsWarper(k))
        if p is not None and p < 1.0:
            warpers.append(TopPLogitsWarper(p))
        rows.append(warpers(torch.zeros(1, 1, dtype=torch.long), row[None].float()).softmax(-1)[0])
    return torch.stack(rows)


SETTINGS = [  # (temperature, top_k, top_p) per row
    (1.0, 50, None), (0.7, None, 0.9), (1.3, 20, 0.8), (0.5, 1, None), (1.0, None, 0.5), (2.0, 5000, 0.95),
    (0.3, 30, 1.0),
]


def assert_draws_follow_the_warpers(device: str) -> None:
    """3000 seeded draws of ``SETTINGS`` rows (and a plain one) on ``device``: a removed token is
    never drawn, the others as often as the warpers' probabilities say."""
    torch.manual_seed(0)
    logits = torch.randn(len(SETTINGS) + 1, 12) * 2  # the last row: plain sampling over the whole vocabulary
    settings = SETTINGS + [(1.0, None, None)]
    temperature, top_k, top_p = zip(*settings)
    expected = warped_probs(logits, temperature, top_k, top_p)
    draws = 3000
    generator = torch.Generator(device=device).manual_seed(1)
    logits = logits.to(device)
    tokens = torch.tensor([sample_tokens(logits, temperature, top_k, top_p, [generator] * len(settings))
                           for _ in range(draws)])  # [draws, rows]
    counts = torch.stack([torch.bincount(tokens[:, r], minlength=12) for r in range(len(settings))])
    assert not bool(counts[expected == 0].any())  # a removed token is never drawn
    assert (counts / draws - expected).abs().max() < 0.035  # ~4 standard deviations at 3000 draws
