"""Speculative decoding in the Engine: drafted tokens verified in one packed forward change no
token (greedy: stock's; sampled: the non-speculative engine's draws), and rejected drafts'
slots are given back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from flexpage import SamplingParams, zoo
from flexpage.engine.speculative import NgramProposer
from reference import NEW_TOKENS, make_engine, stock_greedy, workload


def naive_lookup(tokens, k, max_n, min_n):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(0, 6), st.integers(1, 4), st.integers(0, 3))
def test_ngram_proposer_is_the_latest_longest_match(tokens, k, max_n, shorter):
    min_n = max(1, max_n - shorter)
    assert NgramProposer(max_n, min_n)(tokens, k) == naive_lookup(tokens, k, max_n, min_n)


def looping_prompts():
    """Prompts that repeat themselves (prompt lookup finds drafts) beside plain random ones."""
    plain = workload()
    return [p[:9] * 4 for p in plain[:4]] + plain[4:]


@pytest.fixture(scope="module")
def expected(stock_llama):
    return [stock_greedy(stock_llama, p, n) for p, n in zip(looping_prompts(), NEW_TOKENS)]


def test_ngram_speculation_keeps_stock_greedy_tokens_and_gives_back_rejected_slots(expected):
    engine = make_engine(speculative="ngram", num_speculative_tokens=4, max_tokens_per_step=512)  # prompts: one step
    for prompt, n in zip(looping_prompts(), NEW_TOKENS):
        engine.add_request(prompt, SamplingParams(max_new_tokens=n))
    outputs = {i: [] for i in range(len(expected))}
    while engine.has_work:
        for record in engine.step():
            outputs[record.index].append(record.token)
        running, _ = engine.queue()  # every running sequence holds exactly its computed tokens: no draft left over
        held = engine.cache.stats().live_tokens
        assert held == sum(len(looping_prompts()[i]) + len(outputs[i]) - 1 for i in running)
    assert [outputs[i] for i in range(len(expected))] == expected
    stats = engine.stats()
    assert stats.drafted_tokens > 0 and 0 < stats.accepted_tokens <= stats.drafted_tokens
    assert stats.steps < sum(NEW_TOKENS) and stats.tokens_per_verification > 1
    history = engine.history  # each step's share
    assert sum(h.drafted_tokens for h in history) == stats.drafted_tokens
    assert sum(h.accepted_tokens for h in history) == stats.accepted_tokens
    assert sum(h.verifications for h in history) == stats.verifications
    assert engine.cache.stats().pages_used == 0


def test_speculation_under_preemption_and_prefix_hits_keeps_stock_tokens(stock_llama, expected):
    # 24 pages of 16 tokens: the 200-token prompt and its neighbours cannot all stay resident
    prompts, counts = workload() + looping_prompts()[:2], list(NEW_TOKENS) + [12, 5]
    want = [stock_greedy(stock_llama, p, n) for p, n in zip(workload(), NEW_TOKENS)] + expected[:2]
    engine = make_engine(speculative="ngram", max_cached_tokens=384, num_speculative_tokens=3)
    assert engine.generate(prompts, max_new_tokens=counts) == want
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.accepted_tokens > 0
    assert engine.generate(looping_prompts()[:2], max_new_tokens=[12, 5]) == expected[:2]
    assert engine.stats().prefix_hit_tokens > 0


def oracle_of(expected, right: bool):
    """A proposer drafting each looping prompt's stock continuation, or always the wrong tokens."""
    known = {tuple(p): p + e for p, e in zip(looping_prompts(), expected)}

    def oracle(tokens, k):
        full = next(v for key, v in known.items() if list(key) == list(tokens[: len(key)]))
        drafts = full[len(tokens) : len(tokens) + k]
        return drafts if right else [(t + 1) % 256 for t in drafts]

    return oracle


@pytest.mark.parametrize("alpha", [1.0, 0.0])
def test_a_proposer_right_or_wrong_changes_no_token(expected, alpha):
    """An oracle proposing the model's own next tokens is always accepted (k + 1 tokens per
    forward); one always wrong is never, and both give the stock tokens."""
    engine = make_engine(speculative=oracle_of(expected, alpha == 1.0), num_speculative_tokens=4)
    assert engine.generate(looping_prompts(), max_new_tokens=list(NEW_TOKENS)) == expected
    stats = engine.stats()
    assert stats.drafted_tokens > 0
    assert stats.acceptance_rate == alpha
    if alpha == 1.0:
        assert stats.steps < sum(NEW_TOKENS) // 3


@pytest.mark.parametrize("requests, max_batch_size, drafts", [(1, 8, 3), (2, 8, 3), (1, 2, 4)])
def test_verification_steps_run_as_compiled_decode_steps(expected, requests, max_batch_size, drafts):
    """After the prompts' step, every step verifying drafts runs its bucket's compiled static step
    (each fed token a decode row), with stock's tokens; a lone sequence's verification too where
    its rows outnumber the batch's sequences (5 rows, at most 2 sequences), in a bucket of exactly
    its rows (5, not 8: no padding rows for the linear layers to multiply)."""
    engine = make_engine(speculative=oracle_of(expected, True), num_speculative_tokens=drafts,
                         max_batch_size=max_batch_size)
    buckets = []
    step = engine.runner.graphs.run
    engine.runner.graphs.run = lambda rows, ids, decode_len: buckets.append(decode_len) or step(rows, ids, decode_len)
    prompts, counts = looping_prompts()[2 : 2 + requests], list(NEW_TOKENS[2 : 2 + requests])
    assert engine.generate(prompts, max_new_tokens=counts) == expected[2 : 2 + requests]
    stats = engine.stats()
    assert stats.verifications >= stats.steps - 1 > 1 and stats.compiled_steps == stats.steps - 1
    assert buckets[0] == requests * (1 + drafts) and set(buckets) <= {1, 2, 4, requests * (1 + drafts)}


def test_sampled_speculation_draws_what_the_plain_engine_draws():
    """With seeds, a speculating engine samples each token from the same distribution with the
    same draw as the plain engine (penalties and stop tokens included): the same tokens."""
    options = dict(max_new_tokens=list(NEW_TOKENS), do_sample=True, temperature=0.7, top_k=20, seed=7,
                   repetition_penalty=1.1, eos_token_id=[5])
    plain = make_engine().generate(looping_prompts(), **options)
    engine = make_engine(speculative="ngram")
    assert engine.generate(looping_prompts(), **options) == plain
    assert engine.stats().drafted_tokens > 0
    forks = dict(options, max_new_tokens=20, num_return_sequences=3)  # samples forked from one prompt
    assert engine.generate(looping_prompts()[:3], **forks) == make_engine().generate(looping_prompts()[:3], **forks)


def test_speculation_options_are_checked():
    with pytest.raises(ValueError, match="speculative must be"):
        make_engine(speculative="eagle", warmup=False)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(speculative="ngram", num_speculative_tokens=0, warmup=False)


def test_drafts_outside_the_vocabulary_are_cut(expected):
    engine = make_engine(speculative=lambda tokens, k: [tokens[-1], 10**9, 1], num_speculative_tokens=3)
    assert engine.generate(looping_prompts(), max_new_tokens=list(NEW_TOKENS)) == expected
    assert engine.stats().drafted_tokens == engine.stats().verifications  # one draft each: cut at 10**9


def test_adaptive_speculation_backs_off_drafts_that_keep_failing(expected):
    """Drafts that are always wrong: adaptive speculation shortens them to one token and then
    pauses them, so few tokens are drafted; without it every step drafts all it may."""
    def wrong(tokens, k):
        return [(tokens[-1] + 1 + i) % 256 for i in range(k)]

    drafted = {}
    for adaptive in (True, False):
        engine = make_engine(speculative=wrong, num_speculative_tokens=4, adaptive_speculation=adaptive)
        assert engine.generate(looping_prompts(), max_new_tokens=list(NEW_TOKENS)) == expected
        drafted[adaptive] = engine.stats().drafted_tokens
    assert drafted[True] * 4 < drafted[False]


@pytest.mark.parametrize("draft_seed", [0, 1])
def test_a_draft_model_changes_no_token(expected, draft_seed):
    """A draft model (an Engine of its own) with the target's weights has every draft accepted;
    one with other weights changes no token either."""
    engine = make_engine(speculative=zoo.build("llama-tiny", seed=draft_seed), num_speculative_tokens=3)
    assert engine.generate(looping_prompts(), max_new_tokens=list(NEW_TOKENS)) == expected
    stats = engine.stats()
    assert stats.drafted_tokens > 0
    if draft_seed == 0:
        assert stats.accepted_tokens == stats.drafted_tokens and stats.steps < sum(NEW_TOKENS) // 2
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(speculative=zoo.build("llama-tiny", vocab_size=300), warmup=False)


def test_a_failing_draft_model_costs_only_its_speculation(expected, monkeypatch):
    draft = zoo.build("llama-tiny")
    engine = make_engine(speculative=draft, num_speculative_tokens=3)

    def broken(*args, **kwargs):
        raise RuntimeError("the draft model broke")

    monkeypatch.setattr(draft, "forward", broken)  # its next prefill fails
    assert engine.generate(looping_prompts(), max_new_tokens=list(NEW_TOKENS)) == expected
    assert engine.stats().drafted_tokens == 0
