"""Shared test helpers: fill a paged cache from contiguous tensors, reference attention, and stock
``generate()`` with the logit penalties and bias a request may ask for."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList

import flexpage
from flexpage import masks

GARBAGE = 1e4  # what unwritten slots hold: any read of one shows up as a huge error


def make_cache(page_size, num_pages, num_kv_heads, head_dim, dtype=torch.float32, max_batch_size=8, seed=0,
               device="cpu"):
    """A one-layer cache whose free list is shuffled, so pages land scattered over the pool."""
    cache = flexpage.PagedKVCache(
        num_layers=1,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        num_pages=num_pages,
        max_batch_size=max_batch_size,
        dtype=dtype,
        device=device,
    )
    free = list(cache.page_table.free_pages)
    random.Random(seed).shuffle(free)
    cache.page_table.free_pages.clear()
    cache.page_table.free_pages.extend(free)
    for pool in (cache.layers[0].keys, cache.layers[0].values):
        pool.fill_(GARBAGE)
    return cache


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
    mask_mod = masks.causal if mask_mod is None else mask_mod
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
