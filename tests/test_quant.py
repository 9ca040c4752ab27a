"""Quantised KV pages (``kv_dtype``): the rounding of one token's K/V against its closed-form
bound, bytes per token, and greedy tokens of ``wrap`` and the Engine equal to stock ``generate()``
over a dynamic cache that rounds K/V as the pages do (``reference.RoundedKVCache``)."""

from __future__ import annotations

import pytest
import torch

import flexpage
from flexpage import zoo
from flexpage.core import quant
from flexpage.hf import cache_argument
from reference import NEW_TOKENS, RoundedKVCache, make_cache, make_engine, workload

FORMATS = list(quant.KV_DTYPES.items())[:2]  # int8, float8_e4m3fn


def stock_rounded(model, prompts, new_tokens, kv_dtype):
    """Stock greedy ``generate()`` of each prompt alone, its K/V rounded as ``kv_dtype`` pages store them."""
    outputs = []
    for prompt, n in zip(prompts, new_tokens):
        cache = RoundedKVCache(kv_dtype, config=model.config)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             **{cache_argument(model): cache})
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("name, dtype", FORMATS)
def test_each_value_is_within_its_formats_rounding_of_the_original(name, dtype):
    torch.manual_seed(0)
    states = torch.randn(3, 5, 64) * torch.logspace(-6, 4, 5)[None, :, None]  # vectors of very different sizes
    states[0, 0] = 0  # an all-zero vector stays zero
    packed = quant.quantise(states, dtype)
    assert packed.dtype == dtype and packed.shape == (3, 5, 64 + quant.SCALE_WIDTH)
    back = quant.dequantise(packed, torch.float32)
    amax = states.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:  # half a step of absmax / 127 (the scale rounded to bfloat16: 2^-8 more)
        bound = amax / 127 * (0.5 + 2**-7)
    else:  # e4m3: 3 mantissa bits, relative 2^-4; subnormals (below 2^-6 scaled) 2^-10 of the scale
        bound = states.abs() * 2**-4 + amax / 448 * 2**-9
    assert ((back - states).abs() <= bound * 1.001).all()
    assert back[0, 0].eq(0).all()
    assert (back.abs().amax(-1, keepdim=True) >= amax * 0.99).all()  # the largest value survives


def test_bytes_per_token_of_quantised_pages():
    def cache(dtype, kv_dtype=None):
        return flexpage.PagedKVCache(num_layers=8, num_kv_heads=2, head_dim=64, page_size=16, num_pages=4,
                                     max_batch_size=1, dtype=dtype, kv_dtype=kv_dtype)

    fp32, bf16 = cache(torch.float32).bytes_per_token, cache(torch.bfloat16).bytes_per_token
    assert fp32 == 8 * 2 * 2 * 64 * 4 and bf16 == fp32 // 2
    for name, _ in FORMATS:
        assert cache(torch.float32, name).bytes_per_token == 8 * 2 * 2 * (64 + 2)  # the scale included
        assert cache(torch.float32, name).bytes_per_token / fp32 <= 0.27
        assert cache(torch.bfloat16, name).bytes_per_token / bf16 <= 0.53


def test_bad_kv_dtypes_and_quantised_pools_in_paged_attention_are_refused():
    with pytest.raises(ValueError, match="kv_dtype must be"):
        make_cache(16, 4, 2, 32, kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype must be"):
        make_cache(16, 4, 2, 32, kv_dtype=torch.float16)  # neither quantised nor the model's dtype
    cache = make_cache(16, 4, 2, 32, kv_dtype="int8")
    pool = cache.layers[0].keys
    with pytest.raises(ValueError, match="quantised pools are attended by packed_attention"):
        flexpage.paged_attention(torch.zeros(1, 4, 1, 32), pool, pool, None)


@pytest.mark.parametrize("arch, name, compiled", [
    ("llama", "int8", True), ("llama", "float8_e4m3fn", False),
    ("gemma2", "int8", False),  # Gemma 2: sliding windows and soft-capped scores
])
def test_wrapped_generate_over_quantised_pages_matches_stock_over_rounded_kv(arch, name, compiled):
    """Eagerly a padded batch, then one sequence; compiled, one sequence through its static decode step."""
    stock, dtype = zoo.build(f"{arch}-tiny"), quant.KV_DTYPES[name]
    prompts = workload((40, 13))
    model = flexpage.wrap(zoo.build(f"{arch}-tiny"), kv_dtype=name, compile_decode=compiled,
                          max_batch_size=1 if compiled else 2)
    if not compiled:
        ids = torch.tensor([[0] * 27 + prompts[1], prompts[0]])
        out = model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected = stock_rounded(stock, prompts[::-1], [12, 12], dtype)  # a row that stops is padded after
        assert out[:, 40:].tolist() == [tokens + [0] * (12 - len(tokens)) for tokens in expected]
    out = model.generate(torch.tensor([prompts[0]]), max_new_tokens=16, do_sample=False)
    assert out[0, 40:].tolist() == stock_rounded(stock, prompts[:1], [16], dtype)[0]
    if compiled:
        assert flexpage.paged_state(model).steps.steps > 0  # decode ran as the compiled static step


def test_engine_over_int8_pages_matches_stock_with_prefix_caching_preemption_and_drafts(stock_llama):
    """A pool too small for the workload (preemption recomputes into quantised pages), then prompts
    that share a prefix (served from quantised prefix pages), speculating all along (rejected drafts
    rolled back): stock's tokens over rounded K/V."""
    engine = make_engine(kv_dtype="int8", max_cached_tokens=384, compile_decode=False, speculative="ngram",
                         num_speculative_tokens=3)
    prompts = workload()
    assert engine.generate(prompts, max_new_tokens=list(NEW_TOKENS)) == stock_rounded(
        stock_llama, prompts, NEW_TOKENS, torch.int8)
    assert engine.stats().preemptions > 0
    shared = workload((64,), seed=3)[0]
    forks = [shared + tail for tail in workload((5, 9), seed=4)]
    assert engine.generate(forks, max_new_tokens=[10, 10]) == stock_rounded(stock_llama, forks, [10, 10], torch.int8)
    assert engine.stats().prefix_hit_tokens >= 64 and engine.stats().drafted_tokens > 0
    assert engine.cache.stats().pages_used == 0

