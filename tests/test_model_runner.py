"""ModelRunner at its boundaries: a scheduled batch in, each sequence's pick out. Greedy picks are
the stock model's next tokens; a forward that raises is a StepFailedError after which the
scheduler's rollback leaves the page table as it was; a pick that fails fails its request alone;
warm-up leaves the pool, the prefix cache and the rows as it found them."""

from __future__ import annotations

import pytest
import torch

import flexpage
from flexpage import OutOfPagesError, SamplingParams, StepFailedError, zoo
from flexpage.engine.sequence import Sequence, sample_generator
from reference import page_state, workload

GREEDY = SamplingParams(max_new_tokens=8, eos_token_id=[])


def small_engine(**options):
    """An engine whose runner, scheduler and blocks the tests drive step by step: two rows (one decode
    bucket), no warm-up, nothing compiled."""
    options = dict(max_cached_tokens=512, max_batch_size=2, max_tokens_per_step=64, warmup=False,
                   compile_decode=False) | options
    return flexpage.Engine(zoo.build("llama-tiny"), **options)


def run(engine, batch):
    """The step's forward and picks, under inference mode as ``Engine.step`` runs them."""
    with torch.inference_mode():
        return engine.runner.run(batch)


@torch.no_grad()
def stock_next(model, tokens):
    """The stock model's greedy next token after ``tokens``."""
    return model(torch.tensor([tokens])).logits[0, -1].argmax().item()


def queued(engine, prompts, params=GREEDY):
    seqs = [Sequence(i, list(p), len(p), params, sample_generator(params, i, torch.device("cpu")))
            for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.scheduler.add(seq)
    return seqs


def test_run_picks_the_stock_models_next_tokens(stock_llama):
    engine = small_engine()
    scheduler = engine.scheduler
    a, b = queued(engine, workload((21, 40)))
    for step in range(3):  # the prompts, packed in one forward; then two decode steps
        batch = scheduler.schedule()
        assert (batch.chunks, batch.decode) == (([(a, 21), (b, 40)], []) if step == 0 else ([], [a, b]))
        result = run(engine, batch)
        assert [(p.seq, p.tokens, p.error) for p in result.picks] == [
            (s, [stock_next(stock_llama, s.tokens)], None) for s in (a, b)]
        # on the CPU SDPA attends the chunks unaligned; the decode tokens are a bucket of 2 rows
        assert (result.decode_len, result.chunk_len) == ((0, 61) if step == 0 else (2, 0))
        scheduler.postprocess(batch, result.picks)
    assert [len(s.output) for s in (a, b)] == [3, 3]


def test_sibling_samples_pick_from_their_parents_row(stock_llama):
    engine = small_engine()
    (parent,) = queued(engine, workload((30,)), SamplingParams(max_new_tokens=4, eos_token_id=[],
                                                               num_return_sequences=2))
    sibling = Sequence(1, list(parent.tokens), 30, parent.params)
    parent.siblings = [sibling]
    batch = engine.scheduler.schedule()
    picks = run(engine, batch).picks
    expected = [stock_next(stock_llama, parent.tokens)]
    assert [(p.seq, p.parent, p.tokens) for p in picks] == [(sibling, parent, expected), (parent, None, expected)]


def test_a_failed_forward_raises_and_rollback_restores_the_page_table(stock_llama, monkeypatch):
    engine = small_engine()
    scheduler = engine.scheduler
    a, b = queued(engine, workload((32, 17)))
    batch = scheduler.schedule()
    scheduler.postprocess(batch, run(engine, batch).picks)
    before, free = page_state(engine.blocks), engine.blocks.num_free_pages
    batch = scheduler.schedule()
    assert engine.blocks.num_free_pages == free - 1  # a's 33rd token took a page

    def device_lost(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.model, "forward", device_lost)
    with pytest.raises(StepFailedError) as failure:
        run(engine, batch)
    assert failure.value.requests == [0, 1] and isinstance(failure.value.__cause__, RuntimeError)
    scheduler.rollback(batch)
    assert page_state(engine.blocks) == before
    monkeypatch.undo()
    batch = scheduler.schedule()  # the same step again, now served
    assert [p.tokens for p in run(engine, batch).picks] == [[stock_next(stock_llama, s.tokens)] for s in (a, b)]


def test_a_failing_pick_fails_its_request_alone(stock_llama, monkeypatch):
    """A draw that raises for one request: the other's draw (top-k 1: the argmax) is its token."""
    engine = small_engine()
    params = SamplingParams(max_new_tokens=4, eos_token_id=[], do_sample=True, top_k=1, seed=5)
    good, bad = queued(engine, workload((12, 25)), params)
    draw = engine.runner.sampler

    def sampler(logits, temperature, top_k, top_p, generators):
        if any(g is bad.generator for g in generators):
            raise RuntimeError("bad draw")
        return draw(logits, temperature, top_k, top_p, generators)

    monkeypatch.setattr(engine.runner, "sampler", sampler)
    batch = engine.scheduler.schedule()
    picks = run(engine, batch).picks
    assert [(p.seq, p.tokens, p.error) for p in picks] == [
        (good, [stock_next(stock_llama, good.tokens)], None), (bad, [], "RuntimeError: bad draw")]
    records = engine.scheduler.postprocess(batch, picks)
    assert [(r.index, r.finish_reason) for r in records] == [(0, None), (1, "error")]
    assert engine.scheduler.running == [good] and bad.row is None


def test_warmup_leaves_pages_prefix_cache_and_rows_as_they_were():
    engine = small_engine(max_cached_tokens=128)  # 8 pages
    prompt = workload((40,))[0]
    engine.generate([prompt], max_new_tokens=1)  # leaves its 2 full pages in the prefix cache
    before, hits = page_state(engine.blocks), engine.blocks.hit_tokens
    assert len(before["cached"]) == 2 and not engine.cache.page_table.active_rows
    assert engine.runner.step_shapes() == [(2, 0)]  # on the CPU: the one decode bucket of 2 rows
    fed = []
    hook = engine.model.register_forward_pre_hook(lambda model, args, kwargs: fed.append(kwargs["input_ids"].shape),
                                                  with_kwargs=True)
    try:
        engine.runner.warmup(engine.blocks, progress=False)
    finally:
        hook.remove()
    assert fed == [(1, 2)]  # it ran: one forward of two scratch decode rows
    assert page_state(engine.blocks) == before and engine.blocks.hit_tokens == hits
    (running,) = queued(engine, [prompt[:39] + [1] * 57])  # 96 tokens: 6 pages, 2 of them the cached ones
    engine.scheduler.schedule()
    assert running.cached_tokens == 32 and engine.blocks.num_unused_pages == 2
    before = page_state(engine.blocks)
    with pytest.raises(OutOfPagesError, match="idle"):  # a decode step of 2 rows needs 3 unused pages
        engine.runner.warmup(engine.blocks, progress=False)
    assert page_state(engine.blocks) == before
