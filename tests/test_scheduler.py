"""Scheduler at its boundaries, without a model: which sequences a step runs and how many tokens
each (the token budget, chunk alignment, rows, FIFO admission, preemption, shared prefixes), the
slots schedule() reserves and rollback() gives back, and what postprocess() does with a step's
picks (tokens, finish reasons, freed pages, forked samples, settled drafts). The steps' picks are
made up here in place of a ModelRunner's; page counts are worked out by hand (16-token pages)."""

from __future__ import annotations

from flexpage import SamplingParams
from flexpage.engine.scheduler import MAX_DRAFT_PAUSE, Scheduler
from flexpage.engine.sequence import Pick, Sequence
from reference import make_blocks, page_state

TOKEN = 1  # what the made-up picks pick unless told otherwise


def make_scheduler(num_pages=16, max_batch_size=4, max_tokens_per_step=64, prefix_caching=True, **options):
    blocks = make_blocks(num_pages, max_batch_size, prefix_caching)
    return Scheduler(blocks, max_batch_size, max_tokens_per_step, **options)


def request(index, length, start=3, max_new_tokens=16, eos=None, samples=1):
    """A request's sequence (its sibling samples attached) with distinct tokens from ``start``."""
    params = SamplingParams(max_new_tokens=max_new_tokens, eos_token_id=eos, num_return_sequences=samples)
    seq, *siblings = [Sequence(index + j, list(range(start, start + length)), length, params) for j in range(samples)]
    seq.siblings = siblings
    return seq


def made_up_picks(batch, tokens=None):
    """A ModelRunner's picks: a token (``tokens[index]``, else TOKEN) for each decoding sequence and each
    prompt the step completes, its unforked samples first (picking from its row)."""
    tokens = tokens or {}
    picks = []
    for seq in batch.decode + [s for s, n in batch.chunks if s.num_computed + n == len(s.tokens)]:
        for sibling in seq.siblings if not seq.output else ():
            picks.append(Pick(sibling, [tokens.get(sibling.index, TOKEN)], [None], parent=seq))
        picks.append(Pick(seq, [tokens.get(seq.index, TOKEN)], [None]))
    return picks


def step(scheduler, tokens=None):
    """Schedule a step, pick, and postprocess it; returns the batch and the step's records."""
    batch = scheduler.schedule()
    return batch, scheduler.postprocess(batch, made_up_picks(batch, tokens))


def chunks(batch):
    return [(seq.index, n) for seq, n in batch.chunks]


def held(scheduler, *seqs):
    """The page-table length of each sequence's row."""
    return [scheduler.blocks.cache.page_table.seq_lens[seq.row] for seq in seqs]


def test_the_token_budget_and_chunk_alignment():
    """Chunks start on ``chunk_block`` boundaries: each costs its tokens rounded up; decode tokens
    cost one each and the rest of the budget is rounded down to whole blocks."""
    scheduler = make_scheduler(max_tokens_per_step=64, chunk_block=16)
    for i, length in enumerate((10, 20, 50)):
        scheduler.add(request(i, length, 100 * i))
    batch, _ = step(scheduler)
    assert chunks(batch) == [(0, 10), (1, 20), (2, 16)] and not batch.decode  # 16 + 32 + 16 = 64
    batch, _ = step(scheduler)
    assert [s.index for s in batch.decode] == [0, 1] and chunks(batch) == [(2, 34)]  # 64 - 2 rounds down to 48
    batch, _ = step(scheduler)
    assert [s.index for s in batch.decode] == [0, 1, 2] and not batch.chunks
    unaligned = make_scheduler(max_tokens_per_step=64, chunk_block=1)  # the CPU runner's: chunks packed unaligned
    for i, length in enumerate((10, 20, 50)):
        unaligned.add(request(i, length, 100 * i))
    assert chunks(step(unaligned)[0]) == [(0, 10), (1, 20), (2, 34)]


def test_a_prompt_longer_than_the_budget_is_chunked_over_steps_and_its_slots_reserved():
    scheduler = make_scheduler(max_tokens_per_step=64)
    seq = request(0, 150)
    scheduler.add(seq)
    for n in (64, 64, 22):
        batch = scheduler.schedule()
        assert chunks(batch) == [(0, n)] and held(scheduler, seq) == [seq.num_computed + n]
        records = scheduler.postprocess(batch, made_up_picks(batch))
        assert [r.token for r in records] == ([TOKEN] if n == 22 else [])  # only the last chunk picks
    batch = scheduler.schedule()
    assert batch.decode == [seq] and held(scheduler, seq) == [151]
    assert scheduler.blocks.num_free_pages == 16 - 10  # 151 tokens: 10 pages


def test_rows_count_the_samples_not_yet_forked():
    scheduler = make_scheduler(max_batch_size=3)
    sampled, other = request(0, 20, max_new_tokens=2, samples=3), request(3, 8, 100)
    scheduler.add(sampled)
    scheduler.add(other)
    batch, _ = step(scheduler)
    assert chunks(batch) == [(0, 20)]  # the other request would take the row its samples need
    assert [s.index for s in scheduler.running] == [0, 1, 2] and list(scheduler.waiting) == [other]
    batch, records = step(scheduler)  # the samples' last tokens
    assert [r.finish_reason for r in records] == ["length"] * 3 and not batch.chunks
    batch, _ = step(scheduler)
    assert chunks(batch) == [(3, 8)]
    assert Scheduler(make_blocks(max_batch_size=2), 8, 64).max_batch_size == 2  # no more rows than the cache has


def test_admission_is_first_come_first_served():
    """A request the pool cannot hold yet keeps later ones waiting, even ones that would fit."""
    scheduler = make_scheduler(num_pages=6, max_tokens_per_step=128)
    first = request(0, 40, max_new_tokens=2)
    scheduler.add(first)
    step(scheduler)  # 3 pages
    big, small = request(1, 60, 100), request(2, 10, 200)  # 4 pages, 1 page
    scheduler.add(big)
    scheduler.add(small)
    batch, _ = step(scheduler)  # the first request's last token
    assert batch.decode == [first] and not batch.chunks and list(scheduler.waiting) == [big, small]
    batch, _ = step(scheduler)
    assert chunks(batch) == [(1, 60), (2, 10)] and scheduler.running == [big, small]


def test_the_youngest_is_preempted_when_the_decode_tokens_do_not_fit():
    scheduler = make_scheduler(num_pages=4, prefix_caching=False)
    old, young, later = request(0, 32, max_new_tokens=3), request(1, 32, 100), request(2, 5, 200)
    scheduler.add(old)
    scheduler.add(young)
    batch, _ = step(scheduler)  # both prompts: the pool is full, and each 33rd token opens a page
    assert chunks(batch) == [(0, 32), (1, 32)] and scheduler.blocks.num_free_pages == 0
    scheduler.add(later)
    batch, _ = step(scheduler)
    assert batch.decode == [old] and not batch.chunks and scheduler.preemptions == 1
    assert (young.row, young.num_computed) == (None, 0) and list(scheduler.waiting) == [young, later]
    assert scheduler.blocks.num_free_pages == 1  # young's 2 pages back, one to old's 33rd token
    step(scheduler)  # old's last token: young needs 3 pages, 1 is free; later waits behind it
    batch, records = step(scheduler)
    assert chunks(batch) == [(1, 33), (2, 5)]  # recomputed: its prompt and its output so far
    assert [(r.index, r.cached_tokens is None) for r in records] == [(1, True), (2, False)]  # young's 2nd token
    assert young.output == [TOKEN, TOKEN] and scheduler.preemptions == 1


def test_a_request_waits_while_another_computes_its_prefix():
    """It shares the page once computed, rather than computing it again alongside."""
    scheduler = make_scheduler(max_tokens_per_step=128)
    first = request(0, 45)
    second = Sequence(1, first.tokens[:40] + [7] * 10, 50)  # the same first 2 pages
    scheduler.add(first)
    scheduler.add(second)
    batch, _ = step(scheduler)
    assert chunks(batch) == [(0, 45)] and list(scheduler.waiting) == [second]  # the budget had room
    batch, records = step(scheduler)
    assert chunks(batch) == [(1, 18)] and second.cached_tokens == 32
    assert [(r.index, r.cached_tokens) for r in records] == [(0, None), (1, 32)]


def test_a_request_waits_while_a_running_prefill_computes_its_next_page():
    scheduler = make_scheduler(max_tokens_per_step=64)
    first = request(0, 100)
    scheduler.add(first)
    step(scheduler)  # 64 tokens: 4 pages registered
    second = request(1, 100)
    second.tokens[96:] = [7] * 4  # the first's 6 pages, then its own
    scheduler.add(second)
    batch, _ = step(scheduler)
    assert chunks(batch) == [(0, 36)] and list(scheduler.waiting) == [second]  # 16 tokens of budget left
    batch, _ = step(scheduler)
    assert chunks(batch) == [(1, 4)] and second.cached_tokens == 96


def test_schedule_reserves_slots_and_rollback_gives_them_back():
    drafts = [9, 9, 9]
    scheduler = make_scheduler(propose=lambda asks: [list(drafts) for _ in asks], num_speculative_tokens=3)
    decoding, verifying = request(0, 32), request(1, 20, 100)
    decoding.draft_pause = 2  # it decodes without drafts for now
    scheduler.add(decoding)
    scheduler.add(verifying)
    step(scheduler)
    fresh = request(2, 30, 200)
    scheduler.add(fresh)
    before = page_state(scheduler.blocks)
    batch = scheduler.schedule()
    assert (batch.decode, batch.verify, chunks(batch)) == ([decoding], [verifying], [(2, 30)])
    assert verifying.drafts == drafts
    assert held(scheduler, decoding, verifying, fresh) == [33, 24, 30]  # num_computed + the step's tokens
    assert scheduler.blocks.num_free_pages == 16 - 7  # 2 + 2 pages held, then 1 + 0 + 2 more
    signature = batch.signature()
    scheduler.rollback(batch)
    assert held(scheduler, decoding, verifying, fresh) == [32, 20, 0] and verifying.drafts == []
    after = page_state(scheduler.blocks)
    assert after["pages"][fresh.row] == [] and before["pages"][fresh.row] is None  # admitted: its row stays, empty
    after["pages"][fresh.row] = None
    assert after == before
    assert scheduler.schedule().signature() == signature  # the step can be taken again


def test_postprocess_appends_tokens_and_finishes_with_their_reasons():
    scheduler = make_scheduler()
    stops, lasts, fails = request(0, 10, eos=9), request(1, 20, 100, max_new_tokens=2), request(2, 5, 200)
    for seq in (stops, lasts, fails):
        scheduler.add(seq)
    _, records = step(scheduler, {0: 4, 1: 4, 2: 4})
    assert [(r.index, r.token, r.finish_reason, r.cached_tokens) for r in records] == [
        (0, 4, None, 0), (1, 4, None, 0), (2, 4, None, 0)]  # first tokens carry the prefix-cache hits
    assert all(r.first_token_seconds is not None for r in records)
    batch = scheduler.schedule()
    picks = made_up_picks(batch, {0: 9, 1: 5})
    picks[2] = Pick(fails, error="RuntimeError: no distribution")
    records = scheduler.postprocess(batch, picks)
    assert [(r.index, r.token, r.finish_reason, r.error) for r in records] == [
        (0, 9, "stop", None), (1, 5, "length", None), (2, None, "error", "RuntimeError: no distribution")]
    assert all(r.cached_tokens is None and r.first_token_seconds is None for r in records)
    assert (stops.output, lasts.output, fails.output) == ([4, 9], [4, 5], [4])
    assert not scheduler.has_work and all(s.row is None for s in (stops, lasts, fails))
    assert scheduler.blocks.num_free_pages == 16 and not scheduler.blocks.cache.page_table.active_rows


def test_sibling_samples_fork_onto_rows_sharing_the_parents_pages():
    scheduler = make_scheduler()
    parent = request(0, 20, samples=3)
    first, second = parent.siblings
    scheduler.add(parent)
    _, records = step(scheduler, {0: 4, 1: 5, 2: 6})
    assert [(r.index, r.token, r.cached_tokens) for r in records] == [(1, 5, 0), (2, 6, 0), (0, 4, 0)]
    assert scheduler.running == [parent, first, second] and parent.siblings == []
    assert [s.output for s in scheduler.running] == [[4], [5], [6]]
    pt = scheduler.blocks.cache.page_table
    pages = pt.pages_of(parent.row)
    assert len({parent.row, first.row, second.row}) == 3
    assert [pt.pages_of(s.row) for s in (first, second)] == [pages, pages]
    assert [pt.ref_counts[p] for p in pages] == [3, 3]
    assert (first.num_computed, second.num_registered) == (20, 1)
    batch = scheduler.schedule()  # each writes its next token: the shared 4-token page is copied for two of them
    assert batch.decode == [parent, first, second] and scheduler.blocks.num_free_pages == 16 - 2 - 2
    lasts = {pt.pages_of(s.row)[1] for s in batch.decode}
    assert len(lasts) == 3 and pt.ref_counts[pages[0]] == 3


def test_abort_drops_waiting_running_and_unforked_samples():
    scheduler = make_scheduler(max_tokens_per_step=64)
    running, waiting, sampled = request(0, 20), request(1, 10, 100), request(2, 100, 200, samples=3)
    scheduler.add(running)
    step(scheduler)
    scheduler.add(sampled)  # its prompt takes more than a step: its samples stay unforked
    step(scheduler)
    scheduler.add(waiting)
    assert sorted(scheduler.abort(lambda s: s.index in (0, 1, 3))) == [0, 1, 3]
    assert scheduler.running == [sampled] and [s.index for s in sampled.siblings] == [4]
    assert not scheduler.waiting and running.row is None
    assert scheduler.blocks.cache.page_table.active_rows == [sampled.row]
    assert scheduler.abort(lambda s: s.index == 99) == []


def test_aborting_a_requests_first_sample_keeps_its_unforked_samples():
    """The other samples take its place: they were not asked to stop."""
    scheduler = make_scheduler(max_tokens_per_step=64)
    queued, started = request(0, 10, samples=2), request(2, 100, 100, samples=3)
    scheduler.add(started)
    step(scheduler)  # 64 of its 100 tokens
    scheduler.add(queued)
    heir, last = started.siblings
    assert scheduler.abort(lambda s: s.index in (0, 2)) == [0, 2]
    assert [s.index for s in scheduler.waiting] == [3, 1] and heir.siblings == [last]
    assert not scheduler.running and started.row is None and scheduler.blocks.num_free_pages == 16
    outputs = {}
    while scheduler.has_work:
        for record in step(scheduler)[1]:
            outputs.setdefault(record.index, []).append(record.token)
    assert sorted(outputs) == [1, 3, 4] and all(len(o) == 16 for o in outputs.values())


def verified(scheduler, tokens, accepted):
    """A step whose speculating sequence picks ``tokens``, its first ``accepted`` drafts among them."""
    batch = scheduler.schedule()
    picks = [Pick(seq, list(tokens), [None] * len(tokens), accepted) for seq in batch.verify]
    scheduler.postprocess(batch, made_up_picks(batch) + picks)
    return batch


def test_settle_gives_back_rejected_drafts_and_adapts_the_draft_length():
    asked = []

    def propose(asks):
        asked.extend(k for _, k in asks)
        return [[9] * k for _, k in asks]

    scheduler = make_scheduler(propose=propose, num_speculative_tokens=4)
    seq = request(0, 30, max_new_tokens=64)
    scheduler.add(seq)
    step(scheduler)  # 31 tokens, 30 computed: 2 pages
    batch = verified(scheduler, [5], 0)  # 4 drafts (35 slots: 3 pages), none accepted
    assert batch.verify == [seq] and asked == [4]
    assert (len(seq.tokens), seq.num_computed, held(scheduler, seq)) == (32, 31, [31])
    assert scheduler.blocks.num_free_pages == 16 - 2 and seq.drafts == []  # the third page back
    assert (seq.draft_len, seq.draft_misses, seq.draft_pause) == (3, 1, 0)
    verified(scheduler, [9, 9, 9, 5], 3)  # the whole draft accepted: two longer next time, at most 4
    assert asked[-1] == 3 and (len(seq.tokens), seq.num_computed, held(scheduler, seq)) == (36, 35, [35])
    assert (seq.draft_len, seq.draft_misses) == (4, 0) and seq.num_registered == 2
    verified(scheduler, [5], 0)
    verified(scheduler, [5], 0)  # two misses in a row: 2 steps without drafts
    assert asked[-2:] == [4, 3] and (seq.draft_len, seq.draft_misses, seq.draft_pause) == (2, 2, 2)
    for _ in range(2):
        batch, _ = step(scheduler)
        assert batch.decode == [seq] and not batch.verify
    assert verified(scheduler, [9, 5], 1).verify == [seq] and asked[-1] == 2
    seq.draft_misses = 40
    verified(scheduler, [5], 0)
    assert seq.draft_pause == MAX_DRAFT_PAUSE
    fixed = make_scheduler(propose=propose, num_speculative_tokens=4, adaptive=False)
    fixed.add(request(0, 30))
    step(fixed)
    verified(fixed, [5], 0)
    assert (fixed.running[0].draft_len, fixed.running[0].draft_pause) == (0, 0)  # always the most drafts
