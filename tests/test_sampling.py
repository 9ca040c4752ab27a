"""Picking next tokens (``flexpage.engine.sampling``) against the reference: ``argmax`` for greedy
rows, transformers' own warpers + softmax for sampled ones."""

import pytest
import torch

from reference import SETTINGS, assert_draws_follow_the_warpers, warped_probs

from flexpage.engine import sampling
from flexpage.engine.sampling import greedy_tokens, kept_candidates, sample_tokens, top_p_filtered


@pytest.mark.parametrize("rows, vocab, dtype", [(1, 32000, torch.float32), (32, 32000, torch.float32),
                                                (5, 1000, torch.float32), (3, 300, torch.bfloat16),
                                                (2, 1000, torch.float32), (4, 1000, torch.float16),
                                                (0, 32000, torch.float32)])
def test_greedy_tokens_equal_argmax_with_ties_and_nans(rows, vocab, dtype):
    torch.manual_seed(rows)
    logits = torch.randn(rows, vocab).to(dtype)
    if rows == 0:  # a step whose chunks all stop mid-prompt samples nothing
        assert greedy_tokens(logits) == []
        return
    logits[0, [7, vocab - 1]] = 100.0  # a tie: the first index wins
    logits[-1, :] = float("-inf")  # nothing finite
    if rows > 2:
        logits[1, [vocab // 2, 3]] = float("nan")  # the first NaN wins, as in argmax
        logits[2, vocab - 1] = 100.0  # the maximum in the last, partial block
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab, spread", [(1000, 3.0), (8000, 0.1)])  # peaked; flat
def test_kept_candidates_are_transformers_warped_distribution(vocab, spread):
    torch.manual_seed(vocab)
    settings = [s for s in SETTINGS if s[1] is not None]  # candidates serve top-k rows
    logits = torch.randn(len(settings), vocab) * spread
    temperature, top_k, top_p = zip(*settings)
    ids, probs = kept_candidates(logits, temperature, top_k, top_p)
    got = torch.zeros_like(logits).scatter(1, ids, probs)
    expected = warped_probs(logits, temperature, top_k, top_p)
    assert torch.equal(got > 0, expected > 0)  # the same tokens kept
    torch.testing.assert_close(got / got.sum(-1, keepdim=True), expected, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("first_width", [256, 3])  # 3: most nuclei pass the candidates (a radix select)
@pytest.mark.parametrize("vocab, spread", [(5000, 0.1), (32000, 3.0), (7, 1.0)])
def test_top_p_filtered_keeps_the_warpers_nucleus_over_the_whole_vocabulary(vocab, spread, first_width,
                                                                           monkeypatch):
    monkeypatch.setattr(sampling, "FIRST_WIDTH", first_width)
    torch.manual_seed(vocab)
    top_p = [0.9, 0.5, 0.99, None, 0.2, 1e-4]  # None: the row stays as it is
    logits = torch.randn(len(top_p), vocab) * spread
    probs = logits.softmax(-1)
    got = top_p_filtered(probs.clone(), top_p)
    expected = warped_probs(logits, [1.0] * len(top_p), [None] * len(top_p), top_p)
    # float32 sums in another order may decide a token whose tokens above hold p within rounding
    # (2e-6 at 0.99 over 9,000 tokens) either way: the mass above each token, summed in float64
    order = probs.double().sort(-1, descending=True)
    above = torch.empty_like(order.values).scatter(1, order.indices, order.values.cumsum(-1) - order.values)
    bound = torch.tensor([float("inf") if p is None else p for p in top_p], dtype=torch.float64)
    decided = (above - bound[:, None]).abs() > 1e-5
    assert torch.equal((got > 0)[decided], (expected > 0)[decided])
    assert int(decided.sum()) > 0.999 * decided.numel()  # all but a few boundary tokens are checked
    assert bool(((got > 0) == (got == probs)).all())  # a kept token keeps its probability
    assert int((got[-1] > 0).sum()) == 1  # a tiny top-p keeps the most likely token alone
    assert torch.equal(got[3], probs[3])


@pytest.mark.parametrize("row_by_row", [True, False])  # the CPU's loop; the one pass other devices take
def test_mass_above_sums_the_more_likely_tokens(row_by_row):
    torch.manual_seed(1)
    probs = (torch.randn(4, 5000) * 2).softmax(-1)
    probs[2, :10] = probs[2, 10]  # ties with the value: not above it
    rows = [0, 2, 3]
    values = [float(probs[0].max()), float(probs[2, 10]), float(probs[3].median())]
    got = sampling.mass_above(probs, rows, values, row_by_row=row_by_row)
    expected = [float(probs[r].double()[probs[r] > v].sum()) for r, v in zip(rows, values)]
    assert got[0] == 0.0  # nothing above the most likely token
    assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("top_p", [None, 1.0])
def test_no_top_p_removes_nothing_even_behind_a_near_certain_token(top_p):
    logits = torch.tensor([[20.0, 0.0, -1.0, -2.0, -30.0, -40.0]])  # the first token's probability rounds to 1
    ids, probs = kept_candidates(logits, [1.0], [3], [top_p])
    got = torch.zeros_like(logits).scatter(1, ids, probs)
    expected = warped_probs(logits, [1.0], [3], [top_p])
    assert torch.equal(got > 0, expected > 0) and int((got > 0).sum()) == 3


# top-p rows over the whole vocabulary: by rejection (4 tries: the exact nucleus is rarely needed;
# 1: often, a mixture), or always from the exact nucleus (0 tries), its threshold from the candidates
# (256) or a radix select (3 candidates: the nuclei pass them); a few rows (a Cdf) or "many" (1: the
# scratch and a BlockedCdf)
@pytest.mark.parametrize("tries, first_width, many_rows", [(4, 256, 16), (1, 256, 16), (0, 256, 16), (0, 3, 16),
                                                           (4, 256, 1)])
def test_draws_follow_the_warped_distribution_and_never_removed_tokens(tries, first_width, many_rows, monkeypatch):
    monkeypatch.setattr(sampling, "NUCLEUS_TRIES", tries)
    monkeypatch.setattr(sampling, "FIRST_WIDTH", first_width)
    monkeypatch.setattr(sampling, "MANY_ROWS", many_rows)
    assert_draws_follow_the_warpers("cpu")


def test_each_row_draws_from_its_own_generator():
    logits = torch.randn(3, 500)
    settings = ([0.8] * 3, [None, 40, None], [None, None, 0.9])

    def draw(seeds):
        return sample_tokens(logits, *settings, [torch.Generator().manual_seed(s) for s in seeds])

    assert draw([1, 2, 3]) == draw([1, 2, 3])
    assert draw([1, 2, 3])[1:] == draw([9, 2, 3])[1:]  # a row's seed changes that row only
    assert [draw([s, 2, 3])[0] for s in range(20)] != [draw([1, 2, 3])[0]] * 20


@pytest.mark.parametrize("vocab", [1000, 768, 100])  # a shorter last block; whole blocks; one short block
@pytest.mark.parametrize("cdf_type", [sampling.Cdf, sampling.BlockedCdf])
def test_cdf_inverts_the_cumulative_weight_and_never_lands_on_a_zero(vocab, cdf_type):
    torch.manual_seed(vocab)
    weights = torch.rand(4, vocab) ** 8  # uneven
    weights[1, vocab // 3 :] = 0.0  # nothing after the first third: whole blocks of zeros
    weights[2, ::2] = 0.0  # every other token
    weights[3] = 0.0
    weights[3, vocab - 1] = 0.5  # the last token alone
    cdf = cdf_type(weights)
    reference = weights.double().cumsum(-1)  # in float64: the intervals the draws must land in
    uniforms = torch.cat([torch.rand(300, 4), torch.tensor([[0.0] * 4, [1 - 2**-24] * 4])])
    for uniform in uniforms:
        tokens = cdf.invert(uniform)
        assert bool((weights.gather(1, tokens[:, None]) > 0).all())
        target = uniform.double() * reference[:, -1]
        end = reference.gather(1, tokens[:, None])[:, 0]
        start = end - weights.double().gather(1, tokens[:, None])[:, 0]
        slack = 1e-5 * reference[:, -1]  # float32 sums in another order
        assert bool(((start <= target + slack) & (target < end + slack)).all())
        assert torch.equal(cdf.invert(uniform[[3, 1]], [3, 1]), tokens[[3, 1]])  # some rows only


def test_a_sampler_reused_over_steps_draws_as_a_fresh_one_and_leaves_the_logits_alone():
    sampler = sampling.Sampler()
    torch.manual_seed(0)
    # 24 rows: the scratch and a BlockedCdf; then fewer rows, another vocabulary and dtype, a temperature per row
    for rows, vocab, dtype in [(24, 1000, torch.float32), (3, 700, torch.bfloat16), (24, 300, torch.float32)]:
        logits = torch.randn(rows, vocab).to(dtype)
        before = logits.clone()
        temperature = [0.7 + 0.1 * (r % 3) for r in range(rows)]
        settings = (temperature, [None] * rows, [0.9 if r % 2 else None for r in range(rows)])
        got = sampler(logits, *settings, [torch.Generator().manual_seed(r) for r in range(rows)])
        assert got == sample_tokens(logits, *settings, [torch.Generator().manual_seed(r) for r in range(rows)])
        assert torch.equal(logits, before)


@pytest.mark.parametrize("rows, vocab", [(5, 1000), (20, 1000), (20, 4096)])  # one CDF; blocked CDFs
def test_rows_with_no_distribution_draw_none_and_leave_the_others_alone(rows, vocab):
    """NaN, +inf and all -inf rows yield None (never a token outside the vocabulary, never an
    error); every other row draws what it draws without them, and a temperature below the floor
    draws as the floor does."""
    torch.manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab)
    broken = logits.clone()
    broken[1, 5], broken[2, 7], broken[3] = float("nan"), float("inf"), float("-inf")
    for top_k, top_p in [(None, None), (5, None), (None, 0.9), (50, 0.8)]:
        def draw(scores, temperature):
            generators = [torch.Generator().manual_seed(i) for i in range(rows)]
            return sample_tokens(scores, [temperature] * rows, [top_k] * rows, [top_p] * rows, generators)

        clean, got = draw(logits, 0.7), draw(broken, 0.7)
        assert got[1:4] == [None] * 3
        assert got[:1] + got[4:] == clean[:1] + clean[4:] and all(0 <= t < vocab for t in clean)
        assert draw(logits, 1e-300) == draw(logits, sampling.MIN_TEMPERATURE)
