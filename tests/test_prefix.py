"""Shared pages in the Engine: prefix caching and parallel samples change no token and save work."""

from __future__ import annotations

import pytest
import torch
from reference import VOCAB, make_engine, stock_greedy

from flexpage import zoo

SYSTEM = 100  # shared prompt tokens: 6 full pages of 16


@pytest.fixture(scope="module")
def shared_workload(stock_llama):
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, VOCAB, (SYSTEM,), generator=g).tolist()
    questions = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (10, 27, 5, 40, 16, 21)]
    prompts = [system + q for q in questions]
    return prompts, [stock_greedy(stock_llama, p, 12) for p in prompts]


def test_prefix_caching_changes_no_token_and_skips_shared_prefill(shared_workload):
    prompts, expected = shared_workload
    cached, plain = make_engine(), make_engine(prefix_caching=False)
    assert cached.generate(prompts, max_new_tokens=12) == expected
    assert plain.generate(prompts, max_new_tokens=12) == expected
    hit, miss = cached.stats(), plain.stats()
    assert miss.prefix_hit_tokens == 0 and hit.prefix_hit_tokens > 0
    assert hit.prompt_tokens_computed + hit.prefix_hit_tokens == miss.prompt_tokens_computed
    assert hit.peak_pages_used < miss.peak_pages_used
    # the pages stay cached after the requests finish: a second round computes only each prompt's tail
    cached.reset_stats()
    assert cached.generate(prompts, max_new_tokens=12) == expected
    assert cached.stats().prefix_hit_tokens == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert cached.cache.stats().pages_used == 0 and cached.cache.stats().pages_cached > 0


def test_prefix_caching_with_preemption_and_eviction(shared_workload):
    prompts, expected = shared_workload
    engine = make_engine(max_cached_tokens=256)  # 16 pages: requests preempt each other, cached pages get evicted
    assert engine.generate(prompts, max_new_tokens=12) == expected
    assert engine.stats().preemptions > 0 and engine.stats().prefix_hit_tokens > 0
    assert engine.cache.stats().pages_used == 0


def test_prefix_caching_over_window_rows_changes_no_token(shared_workload):
    """Gemma 2-shaped: a cached prefix is reused where its windowed layers' pages (given back by the
    rows that computed them, registered first) are cached too; stock's tokens, the same hits."""
    prompts, _ = shared_workload
    stock = zoo.build("gemma2-tiny")
    expected = [stock_greedy(stock, p, 12) for p in prompts]
    engine = make_engine("gemma2")
    assert engine.generate(prompts, max_new_tokens=12) == expected
    assert engine.stats().prefix_hit_tokens > 0
    engine.reset_stats()
    assert engine.generate(prompts, max_new_tokens=12) == expected
    assert engine.stats().prefix_hit_tokens == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert engine.cache.stats().pages_used == 0


def test_parallel_samples_share_the_prompt_pages(shared_workload):
    prompts, expected = shared_workload
    engine = make_engine()
    greedy = engine.generate(prompts[:2], max_new_tokens=12, num_return_sequences=3)
    assert greedy == [expected[0]] * 3 + [expected[1]] * 3  # prompt-major, as generate()
    engine = make_engine(prefix_caching=False)
    kwargs = dict(max_new_tokens=12, num_return_sequences=3, do_sample=True, top_k=20, seed=1)
    samples = engine.generate(prompts[:1], **kwargs)
    assert len(samples) == 3 and len({tuple(s) for s in samples}) == 3
    prompt_pages = -(-len(prompts[0]) // 16)
    # three samples hold the prompt's pages once (plus a private copy of its partial last page each)
    assert engine.stats().peak_pages_used <= prompt_pages + 3 * 2
    assert engine.generate(prompts[:1], **kwargs) == samples  # seeded: reproducible
