"""flexpage.Engine: every request's greedy tokens equal that request run alone through stock
generate(), with continuous batching, ragged steps, chunked prefill and preemption."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import flexpage
from flexpage import zoo
from flexpage.core import linear, static_step
from flexpage.core.pages import RELEASED
from flexpage.core.policy import records_steps
from flexpage.engine import counters, model_runner
from flexpage import InvalidRequestError
from flexpage.bench.measure import compiled_graphs
from reference import LENGTHS, NEW_TOKENS, VOCAB, make_engine, stock_adjusted, stock_greedy, workload


@pytest.fixture(scope="module")
def expected(stock_llama):
    return [stock_greedy(stock_llama, p, n) for p, n in zip(workload(), NEW_TOKENS)]


def test_mixed_workload_matches_stock(expected):
    engine = make_engine()
    outputs = engine.generate(workload(), max_new_tokens=list(NEW_TOKENS))
    assert outputs == expected
    stats = engine.stats()
    assert stats.tokens_generated == sum(NEW_TOKENS)
    assert stats.prompt_tokens_computed == sum(LENGTHS)  # prefilled once: no preemption, no recompute
    assert stats.attention_calls > stats.steps  # some steps mixed decode tokens with prefill chunks
    assert stats.forward_launches == stats.steps and stats.compiled_shapes <= len(engine.step_shapes())
    assert stats.preemptions == 0
    assert engine.cache.stats().pages_used == 0  # every finished request gave its pages back
    # other lengths in the same buckets: no new compiled graph
    graphs = compiled_graphs()
    engine.generate(workload((3, 250, 66, 31, 120, 8), seed=1), max_new_tokens=[40, 3, 17, 26, 9, 33])
    assert compiled_graphs() == graphs


def test_warmup_compiles_every_step_shape_so_serving_compiles_nothing(stock_llama, monkeypatch):
    monkeypatch.setattr(linear, "ranking", {})
    monkeypatch.setattr(linear, "trials", {})
    engine = make_engine(max_tokens_per_step=256)  # warm-up runs in the constructor
    # decode regions of 2+ rows: on CPU a lone decode token and every prefill chunk take SDPA
    assert engine.step_shapes() == [(2, 0), (4, 0), (8, 0)]
    # ... and the linear layers met each decode region's rows: their kernels are being timed
    met = set(linear.ranking) | set(linear.trials)
    packed = engine.stats().packed_weight_bytes > 0  # the default: when the copies fit in memory
    for layer in (engine.model.lm_head, engine.model.model.layers[0].mlp.down_proj):
        assert {(*layer.weight.shape, False, rows, torch.get_num_threads(), "float32", packed)
                for rows in (2, 4, 8)} <= met
    assert engine.stats().warmup_seconds > 0 and engine.stats().steps == 0
    pt = engine.cache.page_table
    assert pt.num_free_pages == pt.num_pages and not pt.active_rows  # scratch rows and pages given back
    prompts, news = workload((250, 3, 111, 47, 190), seed=2), [5, 30, 12, 8, 21]  # lengths no test used
    graphs = compiled_graphs()
    assert engine.generate(prompts, max_new_tokens=news) == [stock_greedy(stock_llama, p, n) for p, n in zip(prompts, news)]
    assert compiled_graphs() == graphs
    assert engine.stats().compiled_shapes <= 3
    assert (8, 0) in make_engine(max_batch_size=6).step_shapes()  # a decode bucket wider than the rows warms up too
    # soft-capped scores (Gemma 2) have no SDPA path: chunk regions compile, in power-of-two buckets
    assert make_engine("gemma2", warmup=False, max_tokens_per_step=256).step_shapes()[:3] == [(0, 64), (0, 128), (0, 256)]


def test_packed_weights_change_no_token(expected, monkeypatch, tmp_path):
    """``pack_weights``: oneDNN on packed copies of the weights (made the fastest kernel here by
    slowing the others) serves the same greedy tokens; an in-place weight change is followed."""
    monkeypatch.setattr(linear, "ranking", {})
    monkeypatch.setattr(linear, "trials", {})
    monkeypatch.setattr(linear, "rankings_file", lambda: tmp_path / "linear-kernels.json")
    monkeypatch.setattr(linear, "KERNELS", dict(linear.KERNELS))
    used = []
    for name, kernel in list(linear.KERNELS.items()):
        def run(*args, name=name, kernel=kernel):
            used.append(name)
            if name != "onednn_packed":
                time.sleep(0.001)
            return kernel(*args)
        linear.KERNELS[name] = run
    engine = make_engine(pack_weights=True)
    used.clear()
    known = set(linear.ranking)
    assert engine.generate(workload(), max_new_tokens=list(NEW_TOKENS)) == expected
    assert all(ranking[0] == "onednn_packed" for key, ranking in linear.ranking.items() if key[-1])
    # the other kernels ran only in the trials of row counts warm-up never met (prefill chunks)
    tried = (set(linear.ranking) | set(linear.trials)) - known
    assert 0 < len(used) - used.count("onednn_packed") <= (len(linear.candidates(True)) - 1) * linear.TRIALS * len(tried)
    lm_head = engine.model.lm_head
    with torch.no_grad():
        lm_head.weight.neg_()  # every greedy token changes: the packed copy must follow
    stock = zoo.build("llama-tiny")
    with torch.no_grad():
        stock.lm_head.weight.neg_()
    prompt = workload()[1]
    assert engine.generate([prompt], max_new_tokens=6) == [stock_greedy(stock, prompt, 6)]
    with pytest.raises(ValueError, match="few_row_linears"):
        make_engine(pack_weights=True, few_row_linears=False, warmup=False)


@pytest.mark.skipif("onednn_packed" not in linear.KERNELS, reason="packed weights need oneDNN")
def test_weights_are_packed_by_default_when_the_copies_fit(expected, monkeypatch):
    """``pack_weights=None`` (the Engine's default) packs when a copy of the float32 weights
    needs at most a quarter of the memory available, and not otherwise; ``False`` never packs.
    Tokens equal stock's either way."""
    weights = sum(layer.weight.nbytes for layer in zoo.build("llama-tiny").modules() if type(layer) is torch.nn.Linear)
    monkeypatch.setattr(linear, "available_memory", lambda: 4 * weights)
    packed = make_engine(warmup=False)
    assert packed.stats().packed_weight_bytes == weights
    flexpage.unwrap(packed.model)  # the copies go with the wrapping
    assert packed.stats().packed_weight_bytes == 0
    assert make_engine(warmup=False, pack_weights=False).stats().packed_weight_bytes == 0
    monkeypatch.setattr(linear, "available_memory", lambda: 4 * weights - 1)
    engine = make_engine(warmup=False)
    assert engine.stats().packed_weight_bytes == 0
    assert engine.generate(workload()[:3], max_new_tokens=list(NEW_TOKENS[:3])) == expected[:3]


def test_a_lone_request_decodes_one_token_per_step(stock_llama):
    engine = make_engine(warmup=False)
    prompt = workload((70,))[0]
    engine.add_request(prompt, flexpage.SamplingParams(max_new_tokens=6))
    tokens = []
    while engine.scheduler.has_work:
        tokens += [record.token for record in engine.step()]
        assert engine.cache.step.q_len in (1, 70)  # no padding: SDPA attends the prompt, unaligned, on CPU
    assert tokens == stock_greedy(stock_llama, prompt, 6)
    assert engine.stats().steps == 6  # one prefill step, then one step per further token


def test_forwards_feed_no_padding_tokens(stock_llama):
    """Eager steps: three decode tokens are three rows of every linear layer; only attention's
    batch of one-token rows is padded to the bucket (4) its compiled graph was built for. On CPU,
    where SDPA attends each prefill chunk on its own, chunks are packed unaligned. (A compiled
    step feeds its whole bucket: its shapes are static.)"""
    engine = make_engine(compile_decode=False)
    prompts = workload((9, 40, 21))
    for prompt in prompts:
        engine.add_request(prompt, flexpage.SamplingParams(max_new_tokens=5))
    fed = []
    hook = engine.model.model.embed_tokens.register_forward_hook(lambda m, args, out: fed.append(args[0].shape[1]))
    outputs = {i: [] for i in range(3)}
    try:
        while engine.scheduler.has_work:
            for record in engine.step():
                outputs[record.index].append(record.token)
            plan = engine.cache.step
            if not plan.chunks:  # a pure decode step
                assert fed[-1] == plan.q_len == plan.num_decode == 3 and plan.decode_len == 4
    finally:
        hook.remove()
    assert fed[0] == sum(map(len, prompts))  # the prompts' step
    assert fed.count(3) == 4  # four more tokens each after it
    assert list(outputs.values()) == [stock_greedy(stock_llama, p, 5) for p in prompts]


def test_a_prompt_longer_than_a_step_is_prefilled_over_several_steps(stock_llama):
    engine = make_engine(warmup=False, max_tokens_per_step=64)
    prompt = workload((150,))[0]
    assert engine.generate([prompt], max_new_tokens=4) == [stock_greedy(stock_llama, prompt, 4)]
    assert engine.stats().steps == 3 + 3  # chunks of 64, 64 and 22 tokens (the first two sample nothing), then 3 decodes


def test_history_keeps_the_latest_steps(monkeypatch):
    """A server steps for days: ``history`` is a window of the latest steps, not a growing list."""
    monkeypatch.setattr(counters, "HISTORY_STEPS", 4)
    engine = make_engine(warmup=False, max_tokens_per_step=64)
    engine.generate(workload((150,)), max_new_tokens=4)  # chunks of 64, 64 and 22 tokens, then 3 decodes
    assert engine.stats().steps == 6
    assert [(h.decode_tokens, h.prefill_tokens) for h in engine.history] == [(0, 22), (1, 0), (1, 0), (1, 0)]
    assert engine.history[-1].pages_used == 0  # the request finished in the last step: its pages are free
    assert [h.time for h in engine.history] == sorted(h.time for h in engine.history)


def test_step_records_carry_each_outputs_first_token_facts_and_end(expected):
    """``step()`` returns one record per output it advanced: the first carries the time to it and
    the prompt tokens served from the prefix cache, the last the finish reason; nothing about a
    finished request stays behind in the engine."""
    engine = make_engine()
    prompts = workload()
    for prompt, n in zip(prompts, NEW_TOKENS):
        engine.add_request(prompt, flexpage.SamplingParams(max_new_tokens=n))
    records: dict[int, list] = {i: [] for i in range(len(prompts))}
    while engine.has_work:
        for record in engine.step():
            records[record.index].append(record)
    assert [[r.token for r in rs] for rs in records.values()] == expected
    for rs, tokens in zip(records.values(), expected):
        assert rs[0].first_token_seconds > 0 and rs[0].cached_tokens == 0
        assert all(r.first_token_seconds is None and r.cached_tokens is None for r in rs[1:])
        assert [r.finish_reason for r in rs] == [None] * (len(rs) - 1) + ["stop" if tokens[-1] == 2 else "length"]
    assert not engine.has_work and engine.queue() == ([], []) and engine.cache.stats().pages_used == 0
    again = engine.add_request(prompts[5], flexpage.SamplingParams(max_new_tokens=1))  # 200 tokens: 12 full pages
    (record,) = engine.step()
    assert (record.index, record.cached_tokens, record.finish_reason) == (again, 192, "length")


def test_preemption_under_a_small_pool_changes_no_token(expected):
    # 24 pages of 16 tokens: the 200-token prompt plus its neighbours cannot all stay resident
    engine = make_engine(max_cached_tokens=384)
    outputs = engine.generate(workload(), max_new_tokens=list(NEW_TOKENS))
    assert outputs == expected
    assert engine.stats().preemptions > 0
    assert engine.stats().peak_pages_used <= 24
    assert engine.cache.stats().pages_used == 0


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])  # sliding windows; Gemma 2 also soft-caps logits
def test_attention_variants_match_stock(arch):
    stock = zoo.build(f"{arch}-tiny")
    prompts, news = workload((40, 130, 9, 75)), [20, 12, 25, 16]
    expected = [stock_greedy(stock, p, n) for p, n in zip(prompts, news)]
    engine = make_engine(arch)
    assert engine.generate(prompts, max_new_tokens=news) == expected
    # every Mistral layer attends 32 positions back: rows give back older pages; Gemma 2's global layers keep all
    assert engine.cache.page_table.window == (32 if arch == "mistral" else None)


def test_a_windowed_model_holds_its_windows_pages_only_and_verifies_drafts_within_them():
    """Mistral-shaped (every layer windowed): four sequences that would need 32 pages of a pool of
    24 run without preemption, speculating (rejected drafts roll back inside the window)."""
    stock = zoo.build("mistral-tiny")
    prompts, news = workload((40, 130, 9, 75)), [60, 40, 80, 50]
    expected = [stock_greedy(stock, p, n) for p, n in zip(prompts, news)]
    engine = make_engine("mistral", max_cached_tokens=384, speculative="ngram", num_speculative_tokens=3,
                         compile_decode=False)
    assert engine.generate(prompts, max_new_tokens=news) == expected
    stats = engine.stats()
    assert stats.preemptions == 0 and stats.drafted_tokens > 0 and stats.peak_pages_used <= 24
    assert engine.cache.stats().pages_used == 0


def test_a_gemma2_shaped_model_keeps_only_the_window_of_its_windowed_layers():
    """Gemma 2-shaped (windowed layers beside global ones): a sequence's windowed layers' K/V, in its
    window row, take only its last window's pages once it decodes, from the pool its global layers'
    row draws on; stock's tokens, speculating too (rejected drafts roll both rows back)."""
    stock = zoo.build("gemma2-tiny")
    prompts, news = workload((40, 130, 9, 75)), [60, 40, 80, 50]
    expected = [stock_greedy(stock, p, n) for p, n in zip(prompts, news)]
    engine = make_engine("gemma2", speculative="ngram", num_speculative_tokens=3, compile_decode=False)
    pt, window = engine.cache.page_table, engine.model.config.sliding_window
    indices = [engine.add_request(p, flexpage.SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, news)]
    outputs, checked = {i: [] for i in indices}, 0
    for record in engine.run():
        outputs[record.index].append(record.token)
        for row in pt.active_rows:
            window_row = pt.window_row(row)
            if pt.seq_lens[row] > max(map(len, prompts)):  # decoding: its window and the step's tokens
                assert len(pt.seq_pages[window_row]) - pt.first_held[window_row] <= -(-(window + 4) // 16) + 1
                assert pt.first_held[row] == 0 and RELEASED not in pt.pages_of(row)
                checked += 1
    assert [outputs[i] for i in indices] == expected and checked > 0
    assert engine.stats().preemptions == 0 and engine.cache.stats().pages_used == 0
    # alone in a small pool, a request of every token the engine admits runs to its end beside its window row
    small = make_engine("gemma2", max_cached_tokens=256, compile_decode=False, warmup=False)
    limit = small.max_seq_len
    assert limit < small.cache.page_table.num_pages * 16
    prompt = workload((200,))[0]
    assert small.generate([prompt], max_new_tokens=limit - 200) == [stock_greedy(stock, prompt, limit - 200)]
    with pytest.raises(InvalidRequestError):
        small.generate([prompt], max_new_tokens=limit - 199)


def test_stream_yields_each_token_as_produced(expected):
    engine = make_engine()
    streamed: list[list[int]] = [[] for _ in LENGTHS]
    order = []
    for i, token in engine.stream(workload(), max_new_tokens=list(NEW_TOKENS)):
        streamed[i].append(token)
        order.append(i)
    assert streamed == expected
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches > len(LENGTHS)  # requests' tokens interleave: they run together, not one after another


def test_closing_a_stream_early_cancels_its_requests(expected):
    engine = make_engine()
    for count, _ in enumerate(engine.stream(workload(), max_new_tokens=list(NEW_TOKENS)), 1):
        if count == 5:
            break
    assert not engine.scheduler.has_work and engine.cache.stats().pages_used == 0
    assert engine.generate(workload()[:2], max_new_tokens=list(NEW_TOKENS[:2])) == expected[:2]


def test_sampling_is_seeded_and_stops_at_eos(expected):
    engine = make_engine()
    prompts = workload()[:3]
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    first, second = engine.generate(prompts, **kwargs), engine.generate(prompts, **kwargs)
    assert first == second and first[0] != first[1]
    assert all(len(o) == 20 or (len(o) < 20 and o[-1] == engine.model.generation_config.eos_token_id) for o in first)
    assert engine.generate(prompts, **(kwargs | {"seed": 8})) != first
    # greedy with the 3rd greedy token of request 0 as EOS: stops right there, EOS included
    eos = expected[0][2]
    stop = expected[0].index(eos) + 1
    assert engine.generate(workload()[:1], max_new_tokens=12, eos_token_id=eos)[0] == expected[0][:stop]


def test_penalties_and_bias_match_stock_processors(stock_llama):
    """Requests with a repetition penalty, presence / frequency penalties, a logit bias, all of
    them, and none, in the same steps: each greedy output equals stock ``generate()`` with the same
    processors, and each adjustment changed the output; so does a minimum length."""
    prompt = workload((40,))[0]
    plain = stock_adjusted(stock_llama, prompt, 24)
    options = [dict(repetition_penalty=1.8), dict(presence_penalty=1.5, frequency_penalty=2.0),
               dict(logit_bias={plain[0]: -100.0, 7: 4.0}),
               dict(repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=0.4, logit_bias={9: 3.0}), {}]
    engine = make_engine()
    for option in options:
        engine.add_request(prompt, flexpage.SamplingParams(max_new_tokens=24, eos_token_id=[], **option))
    outputs: dict[int, list[int]] = {i: [] for i in range(len(options))}
    for record in engine.run():
        outputs[record.index].append(record.token)
    for index, option in enumerate(options):
        expected = stock_adjusted(stock_llama, prompt, 24, **option)
        assert outputs[index] == expected, option
        assert (expected != plain) == bool(option), option
    # a stop token (the plain output's third) is not picked before min_new_tokens
    eos = plain[2]
    assert engine.generate([prompt], max_new_tokens=24, eos_token_id=eos)[0] == plain[:3]
    longer = engine.generate([prompt], max_new_tokens=24, eos_token_id=eos, min_new_tokens=8)[0]
    assert longer == stock_adjusted(stock_llama, prompt, 24, min_new_tokens=8, eos_token_id=eos) and len(longer) > 8
    # a sampled request sees the adjusted logits too: a bias of 100 makes its token certain
    sampled = engine.generate([prompt], max_new_tokens=6, do_sample=True, top_k=20, seed=3, logit_bias={11: 100.0})
    assert sampled == [[11] * 6]


def test_logprobs_of_a_step_are_each_requests_own(stock_llama):
    """Requests asking for different numbers of alternatives (and one asking none) in the same
    steps each get theirs, against the stock model's log-softmax."""
    engine = make_engine()
    prompts, tops = workload((30, 9, 51)), [3, 0, None]
    for prompt, top in zip(prompts, tops):
        engine.add_request(prompt, flexpage.SamplingParams(max_new_tokens=5, logprobs=top))
    got = {i: [] for i in range(3)}
    while engine.has_work:
        for record in engine.step():
            assert (record.logprobs is None) == (record.index == 2)  # asked for none
            if record.logprobs is not None:
                got[record.index].append(record.logprobs)
    for index in (0, 1):
        ref = stock_llama.generate(torch.tensor([prompts[index]]), max_new_tokens=5, do_sample=False, pad_token_id=0,
                                   eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        tokens = ref.sequences[0, len(prompts[index]):].tolist()
        assert len(got[index]) == 5
        for entry, logits, token in zip(got[index], ref.logits, tokens):
            expected = torch.log_softmax(logits[0].float(), -1)
            assert entry.logprob == pytest.approx(expected[token].item(), abs=1e-4)
            assert len(entry.top) == tops[index]
            values, ids = expected.topk(3)
            assert [t for t, _ in entry.top] == ids[: tops[index]].tolist()
            assert [v for _, v in entry.top] == pytest.approx(values[: tops[index]].tolist(), abs=1e-4)


def test_string_prompts_go_through_the_tokenizer(expected):
    prompts = workload()

    def tokenizer(text):  # stands in for a transformers tokenizer: text -> {"input_ids": [...]}
        return {"input_ids": prompts[int(text)]}

    engine = make_engine(tokenizer=tokenizer)
    assert engine.generate(["0", "1"], max_new_tokens=list(NEW_TOKENS[:2])) == expected[:2]


def test_bad_requests_are_rejected_alone(expected):
    engine = make_engine(max_cached_tokens=512)
    prompts = workload()
    good = [engine.add_request(prompts[0], flexpage.SamplingParams(max_new_tokens=NEW_TOKENS[0]))]
    before = (list(engine.scheduler.waiting), engine.cache.stats())
    for prompt, params, message in [
        ([], None, "empty prompt"),
        ([1] * 600, None, "exceeds"),
        ([5, VOCAB + 3], None, "outside the vocabulary"),
        ([-1, 5], None, "outside the vocabulary"),
        ([5, 6], flexpage.SamplingParams(max_new_tokens=-1), "max_new_tokens"),
        ("a string", None, "tokenizer"),
        ([5, 6], flexpage.SamplingParams(repetition_penalty=0.0), r"repetition_penalty must be in \[0.01, 100\]"),
        ([5, 6], flexpage.SamplingParams(repetition_penalty=1e300), "repetition_penalty must be in"),
        ([5, 6], flexpage.SamplingParams(do_sample=True, seed=2**63), "seed must be an int in the int64 range"),
        ([5, 6], flexpage.SamplingParams(do_sample=True, seed=-(2**63) - 1), "seed must be"),
        ([5, 6], flexpage.SamplingParams(do_sample=True, temperature=float("nan")), "temperature must be finite"),
        ([5, 6], flexpage.SamplingParams(do_sample=True, temperature=float("inf")), "temperature must be finite"),
        ([5, 6], flexpage.SamplingParams(frequency_penalty=2.5), "frequency_penalty must be in"),
        ([5, 6], flexpage.SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias token ids"),
        ([5, 6], flexpage.SamplingParams(logit_bias={5: -101.0}), "logit_bias values"),
        ([5, 6], flexpage.SamplingParams(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(prompt, params)
    assert (list(engine.scheduler.waiting), engine.cache.stats()) == before
    good.append(engine.add_request(prompts[1], flexpage.SamplingParams(max_new_tokens=NEW_TOKENS[1])))
    outputs: dict[int, list[int]] = {i: [] for i in good}
    for record in engine.run():
        outputs[record.index].append(record.token)
    assert [outputs[i] for i in good] == expected[:2]
    # a batch call names every bad prompt and queues none of them
    with pytest.raises(InvalidRequestError, match=r"prompt 1: empty prompt; prompt 2: .*vocabulary"):
        engine.generate([prompts[0], [], [VOCAB]], max_new_tokens=4)
    assert not engine.scheduler.has_work


def test_engine_rejects_a_budget_without_room_for_a_chunk():
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        make_engine(max_batch_size=8, max_tokens_per_step=16)


def test_a_failed_step_gives_its_slots_back_and_serving_resumes(expected, monkeypatch):
    """The model's forward fails in the third step (eager steps: a compiled step runs its saved
    graph, not the instance's ``forward``): its slots go back and the requests are served later."""
    engine = make_engine(compile_decode=False)
    for prompt, n in zip(workload()[:3], NEW_TOKENS[:3]):
        engine.add_request(prompt, flexpage.SamplingParams(max_new_tokens=n))
    real, calls = engine.model.forward, []

    def fails_on_third_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", fails_on_third_step)
    outputs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    with pytest.raises(RuntimeError, match="device lost"):
        for record in engine.run():
            outputs[record.index].append(record.token)
    pt = engine.cache.page_table
    for seq in engine.scheduler.running:  # the page table holds exactly the computed tokens
        assert pt.seq_lens[seq.row] == seq.num_computed
    monkeypatch.undo()
    for record in engine.run():
        outputs[record.index].append(record.token)
    assert [outputs[i] for i in range(3)] == expected[:3]


def test_a_request_with_no_distribution_to_sample_fails_alone(expected, monkeypatch):
    """Logits that turn NaN after one request's adjustments (as an underflowing penalty once did)
    fail that request alone: ``run()`` raises ``RequestFailedError`` naming it, its pages are
    freed, and the other requests of the step go on to stock's tokens."""
    adjust = model_runner.adjust_logits

    def overflowing(logits, tokens, prompt_lens, params, stop_tokens):
        adjust(logits, tokens, prompt_lens, params, stop_tokens)
        for row, p in enumerate(params):
            if p.presence_penalty == 1.5:
                logits[row] = float("nan")

    monkeypatch.setattr(model_runner, "adjust_logits", overflowing)
    engine = make_engine()
    prompts = workload()
    greedy = [engine.add_request(prompts[i], flexpage.SamplingParams(max_new_tokens=NEW_TOKENS[i])) for i in (0, 1)]
    poisoned = engine.add_request(prompts[2], flexpage.SamplingParams(max_new_tokens=8, do_sample=True, seed=3,
                                                                      presence_penalty=1.5))
    outputs: dict[int, list[int]] = {i: [] for i in greedy + [poisoned]}
    with pytest.raises(flexpage.RequestFailedError, match=f"request {poisoned}: nothing could be sampled"):
        for record in engine.run():
            outputs[record.index].append(record.token)
    for record in engine.run():  # the others were left queued
        outputs[record.index].append(record.token)
    assert [outputs[i] for i in greedy] == expected[:2] and outputs[poisoned] == []
    assert not engine.has_work and engine.cache.stats().pages_used == 0


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # Gemma 2: sliding windows and soft-capped scores
def test_compiled_decode_steps_match_stock_and_compile_nothing_after_warmup(arch):
    """Decode-only steps of 2+ sequences through the whole forward compiled, one graph per decode
    bucket built by warm-up (padding rows fed too), attention by ``flexpage::paged_decode`` (Gemma
    2's windowed and soft-capped layers too): stock's tokens, no graph built while serving."""
    stock = zoo.build(f"{arch}-tiny")
    engine = make_engine(arch, compile_decode=True)
    graphs = compiled_graphs()
    steps = engine.runner.graphs
    addresses = {n: [t.data_ptr() for t in static.tensors()] for n, static in steps.static.items()}
    assert set(addresses) == steps.buckets  # every bucket's step inputs built by warm-up
    # a sequence decoding alone (the workload's longest, at its end) is a bucket of one row, no padding
    # row for the linear layers: attended by the C kernel whatever the layer's variant (Gemma 2's soft cap)
    assert 1 in steps.buckets and engine.runner.shape.decode_len(1) == 1
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        outputs = engine.generate(workload(), max_new_tokens=list(NEW_TOKENS))
    assert outputs == [stock_greedy(stock, p, n) for p, n in zip(workload(), NEW_TOKENS)]
    ops = {event.name for event in profile.events()}  # attention by the C kernel through C++, no Python op
    assert "flexpage::paged_decode" in ops and "flexpage::static_decode_attention" not in ops
    assert compiled_graphs() == graphs
    assert engine.stats().compiled_steps > 0
    # the compiled steps read their inputs where warm-up put them: written in place, never reallocated
    assert {n: [t.data_ptr() for t in static.tensors()] for n, static in steps.static.items()} == addresses


class Rerun:
    """A recorder for the CPU in the place of CUDA graphs (``step_graph.CudaGraphs``): ``record`` runs a
    bucket's step once and keeps its logits; a replay runs the step again over the bucket's tensors
    as they are now and writes its logits into that same tensor, as a graph's replay rewrites its
    output. ``buckets``: the buckets recorded, in order."""

    def __init__(self) -> None:
        self.buckets: list[int] = []

    def record(self, step):
        logits = step()
        self.buckets.append(logits.shape[1])

        def replay():
            logits.copy_(step())
            return logits

        return replay


def test_recorded_decode_steps_are_recorded_once_largest_first_and_replayed_with_stocks_tokens(monkeypatch):
    """Where the device records steps (CUDA graphs), warm-up records every bucket once, largest
    first (one memory pool: the smaller reuse the largest's), and each decode step replays its
    bucket, whose logits land in the same tensor at every step: read before the next step writes
    over them, they still give stock's tokens."""
    assert records_steps(torch.device("cuda")) and not records_steps(torch.device("cpu"))  # (the policy's)
    recorder = Rerun()
    monkeypatch.setattr(static_step, "step_recorder", lambda device: recorder)
    stock = zoo.build("llama-tiny")
    engine = make_engine(compile_decode=True)
    buckets = sorted(engine.runner.graphs.buckets, reverse=True)
    assert len(buckets) > 1 and recorder.buckets == buckets and engine.runner.graphs.recorded == len(buckets)
    outputs = engine.generate(workload(), max_new_tokens=list(NEW_TOKENS))
    assert outputs == [stock_greedy(stock, p, n) for p, n in zip(workload(), NEW_TOKENS)]
    assert recorder.buckets == buckets and engine.stats().compiled_steps > 0  # replayed, never recorded again


class Unrecordable:
    def record(self, step):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_bucket_that_cannot_be_recorded_runs_its_compiled_step_as_it_is(monkeypatch, caplog):
    monkeypatch.setattr(static_step, "step_recorder", lambda device: Unrecordable())
    stock = zoo.build("llama-tiny")
    engine = make_engine(compile_decode=True)
    assert "runs without a recorded graph (RuntimeError: operation not permitted" in caplog.text
    outputs = engine.generate(workload(), max_new_tokens=list(NEW_TOKENS))
    assert outputs == [stock_greedy(stock, p, n) for p, n in zip(workload(), NEW_TOKENS)]
    assert engine.runner.graphs.recorded == 0 and engine.stats().compiled_steps > 0


def test_an_engine_of_one_row_compiles_its_decode_steps():
    """``max_batch_size=1`` has no multi-row step to learn the layers' attention variants from:
    warm-up learns them from a scratch row padded to two, so its decode steps run compiled (they
    ran eager before), with stock's tokens, and the pool is left empty."""
    stock = zoo.build("llama-tiny")
    engine = make_engine(compile_decode=True, max_batch_size=1)
    assert engine.runner.graphs.ready(1) and engine.cache.stats().pages_used == 0
    prompts = workload()[:2]
    outputs = engine.generate(prompts, max_new_tokens=list(NEW_TOKENS[:2]))
    assert outputs == [stock_greedy(stock, p, n) for p, n in zip(prompts, NEW_TOKENS[:2])]
    assert engine.stats().compiled_steps >= sum(NEW_TOKENS[:2]) - 2 * 2  # every decode step but each prompt's


@pytest.mark.slow  # subprocesses
def test_compiled_decode_graphs_read_the_weights_at_each_call_and_load_in_a_later_process(tmp_path):
    """The compiled decode forward is one graph per bucket compiled ahead of time and saved
    (``compile.StaticCompiled.keyed``): keyed by the model's architecture and shapes, not its
    weights, so a model of other weights reuses it and still gets its own tokens, and a later
    process loads it from disk instead of tracing the forward (a warm start in seconds)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).parent))
    child = r"""
import json, sys
from flexpage import zoo
from flexpage.core.compile import graph_counts
from flexpage.bench.measure import compiled_graphs
from flexpage import Engine
from reference import NEW_TOKENS, stock_greedy, workload
outputs = {}
for seed in map(int, sys.argv[1:]):
    engine = Engine(zoo.build("llama-tiny", seed=seed), page_size=16, max_cached_tokens=2048, max_batch_size=4,
                    max_tokens_per_step=128, compile_decode=True)
    before = compiled_graphs()
    got = engine.generate(workload()[:4], max_new_tokens=list(NEW_TOKENS[:4]))
    stock = zoo.build("llama-tiny", seed=seed)
    outputs[seed] = {"equal": got == [stock_greedy(stock, p, n) for p, n in zip(workload()[:4], NEW_TOKENS)],
                     "compiled_steps": engine.stats().compiled_steps, "new_graphs": compiled_graphs() - before}
print(json.dumps({"outputs": outputs, **graph_counts()}))
"""

    def run(*seeds: int) -> dict:
        out = subprocess.run([sys.executable, "-c", child, *map(str, seeds)], env=env, capture_output=True, text=True,
                             timeout=900, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(0, 1), run(2)
    for result in (*first["outputs"].values(), *second["outputs"].values()):
        assert result == {"equal": True, "compiled_steps": result["compiled_steps"], "new_graphs": 0}
        assert result["compiled_steps"] > 0
    assert first["loaded"] == 0 and second["loaded"] == second["held"] == first["held"]
    assert len(list((tmp_path / "flexpage").glob("_decode_forward-*.bin"))) == 3  # buckets 1, 2 and 4
