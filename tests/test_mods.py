"""Each mod of the library is a tiny pure function in logical coordinates: check its truth table."""

import pytest
import torch

from flexpage import masks, mods

Q = torch.arange(6)[:, None]
KV = torch.arange(6)[None, :]
B = H = torch.tensor(0)


def test_causal():
    assert torch.equal(mods.causal(B, H, Q, KV), torch.ones(6, 6, dtype=torch.bool).tril())


def test_sliding_window_sees_itself_and_window_minus_one_before():
    m = mods.sliding_window(3)(B, H, Q, KV)
    expect = torch.tensor([[0 <= q - k < 3 for k in range(6)] for q in range(6)])
    assert torch.equal(m, expect)


def test_prefix_lm_is_bidirectional_inside_the_prefix():
    m = mods.prefix_lm(torch.tensor([2, 4]))(torch.tensor(1), H, Q, KV)
    expect = torch.tensor([[k < 4 or k <= q for k in range(6)] for q in range(6)])
    assert torch.equal(m, expect)


def test_softcap_bounds_scores_and_keeps_small_ones():
    s = torch.tensor([-1e4, -1.0, 0.0, 1e-3, 1e4])
    out = mods.softcap(5.0)(s, B, H, Q, KV)
    assert out.abs().max() <= 5.0 and out[3] == pytest.approx(1e-3, rel=1e-4)


def test_alibi_penalises_distance_per_head():
    slopes = mods.alibi_slopes(4)
    assert slopes.tolist() == [2**-2, 2**-4, 2**-6, 2**-8]
    out = mods.alibi(slopes)(torch.zeros(()), B, torch.tensor(1), torch.tensor(9), torch.tensor(5))
    assert out.item() == pytest.approx(-4 * 2**-4)


@pytest.mark.parametrize("make, arg", [(mods.sliding_window, 0), (mods.softcap, 0.0)])
def test_bad_mod_arguments(make, arg):
    with pytest.raises(ValueError):
        make(arg)


def test_grouped_mods_see_query_head_h_times_group_plus_q_at_the_rows_one_query():
    """A one-token row's query laid out [kv_heads, group]: (h, q) is query head h * group + q,
    every q at the row's query position (the mod's own q_idx is 0 for a one-token row)."""
    seen = []

    def record(b, h, q_idx, kv_idx):
        seen.append((int(h), int(q_idx)))
        return kv_idx >= 0

    for h in range(2):
        for q in range(4):
            assert masks.grouped_mask_mod(record, 4)(B, torch.tensor(h), torch.tensor(q), torch.tensor(3))
    assert seen == [(h * 4 + q, 0) for h in range(2) for q in range(4)]
    slopes = mods.alibi_slopes(8)
    grouped = masks.grouped_score_mod(mods.alibi(slopes), 4)
    for h in range(2):
        for q in range(4):  # the query sits at position 0 of the mod's coordinates: score = slope * kv_idx
            out = grouped(torch.zeros(()), B, torch.tensor(h), torch.tensor(q), torch.tensor(5))
            assert out.item() == pytest.approx(slopes[h * 4 + q].item() * 5)
