"""Few-row linear layers: the same product as F.linear, in the orientation measured faster, used
only inside paged forwards."""

import time

import pytest
import torch
import torch.nn.functional as F

import flexpage
from flexpage import linear, zoo
from flexpage.linear import MAX_ROWS, FewRowLinears, few_row_linear, transposed_linear


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (3, 5, 64), (1, 8, 64), (MAX_ROWS, 64), (MAX_ROWS + 1, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("product", ["transposed", "measured"])
def test_few_row_linear_equals_float64_reference(shape, bias, product):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    out_features = 96
    weight = torch.randn(out_features, 64, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    out = (transposed_linear if product == "transposed" else few_row_linear)(x, weight, b)
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.shape == (*shape[:-1], out_features) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    assert out.view(-1, out_features).shape[0] == x.numel() // 64  # callers reshape the output with view()


def test_few_row_linear_takes_non_contiguous_rows():
    x = torch.randn(32, 40).t()[:, :24]  # 40 rows of 24 features, column-major and sliced
    assert not x.is_contiguous()
    weight = torch.randn(16, 24)
    torch.testing.assert_close(transposed_linear(x, weight, None).double(), F.linear(x.double(), weight.double()),
                               rtol=1e-5, atol=1e-5)


def _slowed(product):
    def run(*args):
        time.sleep(0.003)
        return product(*args)
    return run


@pytest.mark.parametrize("slow", ["F.linear", "transposed"])
def test_orientation_is_timed_on_real_calls_then_kept_per_weight_shape_and_row_bucket(monkeypatch, slow):
    monkeypatch.setattr(linear, "faster_transposed", {})
    monkeypatch.setattr(linear, "trials", {})
    used = []
    plain, transposed = F.linear, transposed_linear
    monkeypatch.setattr(F, "linear", lambda *args: used.append("F") or (_slowed(plain) if slow == "F.linear" else plain)(*args))
    monkeypatch.setattr(linear, "transposed_linear",
                        lambda *args: used.append("T") or (_slowed(transposed) if slow == "transposed" else transposed)(*args))
    weight = torch.randn(32, 16)
    for rows in [3, 4, 3, 4, 4, 3, 4, 3, 2, 4, 3]:  # bucket 4 eight times (on trial), then decided; 2 is its own
        x = torch.randn(rows, 16)
        torch.testing.assert_close(few_row_linear(x, weight, None), x @ weight.t(), rtol=1e-5, atol=1e-5)
    faster = "T" if slow == "F.linear" else "F"
    assert used == ["F", "T"] * linear.TRIALS + ["F", faster, faster]  # the bucket-2 call opens its own trial
    assert linear.faster_transposed == {(32, 16, False, 4): slow == "F.linear"}
    assert list(linear.trials) == [(32, 16, False, 2)]
    used.clear()
    few_row_linear(torch.randn(3, 16), weight, torch.randn(32))  # with a bias: another product, on trial anew
    few_row_linear(torch.randn(MAX_ROWS + 1, 16), weight, None)  # past MAX_ROWS: F.linear, nothing timed
    assert used == ["F", "F"] and len(linear.trials) == 2


def _recording(model):
    """Record, at every call of the model's first linear layer, whether the few-row path was on."""
    seen = []
    layer = model._flexpage.linears.layers[0]
    layer.register_forward_hook(lambda *_: seen.append(model._flexpage.linears.active))
    return seen


def test_only_paged_forwards_use_few_row_linears_and_unwrap_restores_the_layers():
    stock = zoo.build("llama-tiny")
    model = flexpage.wrap(zoo.build("llama-tiny"))
    linears = model._flexpage.linears
    assert len(linears.layers) == sum(type(m) is torch.nn.Linear for m in model.modules()) > 0
    seen = _recording(model)
    ids = torch.randint(3, 200, (2, 12))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert seen and all(seen)  # prefill and decode steps through the paged cache
    assert torch.equal(out, stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                           do_sample=False, pad_token_id=0))
    seen.clear()
    assert torch.equal(model(ids).logits, stock(ids).logits)  # a plain forward: stock, bit for bit
    assert seen == [False] and not linears.active
    flexpage.unwrap(model)
    assert all("forward" not in vars(m) for m in model.modules())
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_flag_is_cleared_when_a_paged_forward_raises():
    model = flexpage.wrap(zoo.build("llama-tiny"))
    def fail(*_):
        raise RuntimeError("layer failed")
    model.model.layers[-1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="layer failed"):
        model.generate(torch.randint(3, 200, (1, 8)), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert not model._flexpage.linears.active


def test_layers_replaced_by_others_are_left_alone_and_the_option_turns_it_off():
    model = zoo.build("llama-tiny")
    hooked = model.lm_head
    hooked.forward = lambda x: F.linear(x, hooked.weight)  # as accelerate's offload hooks do
    flexpage.wrap(model)
    assert hooked not in model._flexpage.linears.layers and hooked.forward.__name__ == "<lambda>"
    off = flexpage.wrap(zoo.build("llama-tiny"), few_row_linears=False)
    assert off._flexpage.linears is None and all("forward" not in vars(m) for m in off.modules())
    elsewhere, here = torch.nn.Linear(4, 4, device="meta"), torch.nn.Linear(4, 4)  # off the CPU: left alone
    assert FewRowLinears(torch.nn.Sequential(elsewhere, here), lambda kwargs: True).layers == [here]
    assert "forward" not in vars(elsewhere)


@pytest.mark.parametrize("measured", [True, False])
def test_a_compiled_forward_takes_the_orientation_measured_beforehand(monkeypatch, measured):
    """``wrap(compile_decode=True)`` measures first (``measure``): its traced decode forward then
    takes the faster orientation; with nothing measured a trace times nothing and takes F.linear."""
    monkeypatch.setattr(linear, "faster_transposed", {})
    monkeypatch.setattr(linear, "trials", {})
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 24, bias=False))
    linears = FewRowLinears(model, lambda kwargs: True)
    if measured:
        with monkeypatch.context() as slow:
            slow.setattr(F, "linear", _slowed(F.linear))
            linears.measure(3)  # row buckets 1, 2, 4 of both weight shapes, each met once per sweep
        assert linear.faster_transposed == {(24, n, b, r): True for n, b in ((16, True), (24, False)) for r in (1, 2, 4)}
        assert not linear.trials
    traced = []
    monkeypatch.setattr(linear, "transposed_linear", lambda x, w, b: traced.append(x.shape) or transposed_linear(x, w, b))
    x = torch.randn(2, 16)
    out = torch.compile(model, fullgraph=True, dynamic=False)(x)
    first, second = model
    ref = F.linear(F.linear(x.double(), first.weight.double(), first.bias.double()), second.weight.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert bool(traced) == measured
    assert len(linear.faster_transposed) == (6 if measured else 0) and not linear.trials
