"""Linear layers of paged forwards: the same product as F.linear, through the CPU kernel measured
fastest, used only inside paged forwards."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import flexpage
from flexpage import zoo
from flexpage.hf import cache_argument
from flexpage import PagedKVCache
from flexpage.core import kernels, linear
from flexpage.core.linear import MAX_ROWS, FewRowLinears, fast_linear, onednn_linear, pack_weight, transposed_linear


def packed_onednn_linear(x, weight, bias):
    return onednn_linear(x, pack_weight(weight, 4), bias)


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (3, 5, 64), (1, 8, 64), (MAX_ROWS, 64), (MAX_ROWS + 1, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("product", [transposed_linear, onednn_linear, packed_onednn_linear, fast_linear])
def test_every_kernel_equals_a_float64_reference(shape, bias, product):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    out_features = 96
    weight = torch.randn(out_features, 64, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    with torch.no_grad():  # fast_linear picks a kernel only where no gradient is recorded
        out = product(x, weight, b)
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.shape == (*shape[:-1], out_features) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    assert out.view(-1, out_features).shape[0] == x.numel() // 64  # callers reshape the output with view()


@pytest.mark.parametrize("product", [transposed_linear, onednn_linear, packed_onednn_linear])
def test_kernels_take_non_contiguous_rows(product):
    x = torch.randn(32, 40).t()[:, :24]  # 40 rows of 24 features, column-major and sliced
    assert not x.is_contiguous()
    weight = torch.randn(16, 24)
    torch.testing.assert_close(product(x, weight, None).double(), F.linear(x.double(), weight.double()),
                               rtol=1e-5, atol=1e-5)


def _slowed(product, seconds=0.02):  # far beyond a small product even on a loaded machine
    def run(*args):
        time.sleep(seconds)
        return product(*args)
    return run


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    """No kernel decided or on trial, the kernels' table restorable, rankings saved apart."""
    monkeypatch.setattr(linear, "ranking", {})
    monkeypatch.setattr(linear, "trials", {})
    monkeypatch.setattr(linear, "KERNELS", dict(linear.KERNELS))
    monkeypatch.setattr(linear, "rankings_file", lambda: tmp_path / "linear-kernels.json")


@pytest.mark.parametrize("fast", linear.candidates(packed=False))
def test_kernels_are_timed_on_real_calls_then_kept_per_weight_shape_and_row_bucket(fresh_choices, fast):
    names = list(linear.candidates(packed=False))
    used = []
    for name, kernel in list(linear.KERNELS.items()):
        timed = kernel if name == fast else _slowed(kernel)
        linear.KERNELS[name] = lambda *args, name=name, timed=timed: used.append(name) or timed(*args)
    weight, threads = torch.randn(32, 16), torch.get_num_threads()
    calls = [3, 4] * (len(names) * linear.TRIALS // 2) + [4, 3, 2, 4, 3]  # bucket 4: on trial, then decided
    with torch.no_grad():
        for rows in calls:
            x = torch.randn(rows, 16)
            torch.testing.assert_close(fast_linear(x, weight, None), x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert used == names * linear.TRIALS + [fast, fast, names[0], fast, fast]  # the bucket-2 call opens its own trial
    assert list(linear.ranking) == [(32, 16, False, 4, threads, "float32", False)]
    assert linear.ranking[(32, 16, False, 4, threads, "float32", False)][0] == fast
    assert sorted(linear.ranking[(32, 16, False, 4, threads, "float32", False)]) == sorted(names)
    assert list(linear.trials) == [(32, 16, False, 2, threads, "float32", False)]
    decided = dict(linear.ranking)
    used.clear()
    with torch.no_grad():
        fast_linear(torch.randn(3, 16), weight, torch.randn(32))  # with a bias: another product, on trial anew
        fast_linear(torch.randn(MAX_ROWS + 1, 16), weight, None)  # past MAX_ROWS: F.linear, nothing timed
    fast_linear(torch.randn(3, 16, requires_grad=True), weight, None)  # recording gradients: F.linear, untimed
    assert used == [names[0]] and len(linear.trials) == 2
    # a new process on this CPU and torch starts from what was decided; other thread counts are apart
    linear.ranking.clear()
    linear.load_rankings()
    assert linear.ranking == decided
    with torch.no_grad():
        torch.set_num_threads(threads + 1)
        try:
            fast_linear(torch.randn(4, 16), weight, None)
        finally:
            torch.set_num_threads(threads)
    assert used == [names[0], names[0]] and (32, 16, False, 4, threads + 1, "float32", False) in linear.trials


def test_rankings_of_another_cpu_or_a_broken_file_are_not_taken(fresh_choices):
    path = linear.rankings_file()
    key = f"8,4,0,2,{torch.get_num_threads()},float32,0"
    path.write_text(json.dumps({"Another CPU | torch 0 | plain, transposed": {key: ["transposed", "plain"]}}))
    linear.load_rankings()
    assert linear.ranking == {}
    for broken in ("{not json", json.dumps({linear._machine(): {"8,4": ["plain"]}}), json.dumps([1])):
        path.write_text(broken)
        linear.load_rankings()
        assert linear.ranking == {}
    order = tuple(reversed(linear.candidates(packed=False)))
    linear.ranking[(8, 4, False, 2, torch.get_num_threads(), "float32", False)] = order
    linear.save_rankings()  # a broken file is replaced
    saved = json.loads(path.read_text())
    assert list(saved) == [linear._machine()] and saved[linear._machine()] == {key: list(order)}


def test_rankings_measured_with_another_version_of_the_few_row_kernel_are_not_taken(fresh_choices, monkeypatch):
    """A ranking holds for the kernels it timed: after ``row_linear.c`` (or its op) changes, what was
    decided with the earlier build is measured again, not kept."""
    order = tuple(reversed(linear.candidates(packed=False)))
    key = (8, 4, False, 2, torch.get_num_threads(), "float32", False)
    linear.ranking[key] = order
    linear.save_rankings()
    linear.ranking.clear()
    linear.load_rankings()
    assert linear.ranking == {key: order}  # the same sources: taken
    linear.ranking.clear()
    monkeypatch.setattr(kernels, "source_digest", lambda *names: "another")
    linear.load_rankings()
    assert linear.ranking == {}


def test_packed_copies_are_taken_once_and_follow_the_weights(fresh_choices):
    """``pack``: each float32 layer keeps one packed copy, used by the packed kernel, packed
    again when its weight is changed in place or replaced, and dropped by ``remove``."""
    first, second = torch.nn.Linear(16, 24), torch.nn.Linear(24, 8, bias=False)
    model = torch.nn.Sequential(first, second)
    linears = FewRowLinears(model, lambda kwargs: True)
    assert linears.packed(first) is None and linears.packed_bytes == 0  # no copy before pack()
    linears.pack(4)
    copies = [linears.packed(layer) for layer in (first, second)]
    assert all(copy.is_mkldnn for copy in copies) and linears.packed(first) is copies[0]  # not packed again
    assert linears.packed_bytes == first.weight.nbytes + second.weight.nbytes
    for name in linear.candidates(packed=False):
        linear.KERNELS[name] = _slowed(linear.KERNELS[name])  # the packed kernel wins every trial

    def check():
        x = torch.randn(3, 16)
        with torch.no_grad():
            for _ in range(len(linear.KERNELS) * linear.TRIALS):
                out = model(x)
        ref = F.linear(F.linear(x.double(), first.weight.double(), first.bias.double()), second.weight.double())
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)

    check()
    assert {names[0] for key, names in linear.ranking.items()} == {"onednn_packed"}
    assert {key[-1] for key in linear.ranking} == {True}
    with torch.no_grad():
        first.weight.mul_(-2)  # in place (as load_state_dict, an optimizer step)
    second.weight = torch.nn.Parameter(torch.randn(8, 24))  # replaced
    check()
    assert linears.packed(first) is not copies[0] and linears.packed(second) is not copies[1]
    linears.remove()
    assert not linears._packed
    with pytest.raises(ValueError, match="few_row_linears"):
        flexpage.wrap(zoo.build("llama-tiny"), pack_weights=True, few_row_linears=False)


def _recording(model):
    """Record, at every call of the model's first linear layer, whether the few-row path was on."""
    seen = []
    layer = flexpage.paged_state(model).linears.layers[0]
    layer.register_forward_hook(lambda *_: seen.append(flexpage.paged_state(model).linears.active))
    return seen


def test_only_paged_forwards_use_few_row_linears_and_unwrap_restores_the_layers():
    stock = zoo.build("llama-tiny")
    model = flexpage.wrap(zoo.build("llama-tiny"))
    linears = flexpage.paged_state(model).linears
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
    assert not flexpage.paged_state(model).linears.active


def test_layers_replaced_by_others_are_left_alone_and_the_option_turns_it_off():
    model = zoo.build("llama-tiny")
    hooked = model.lm_head
    hooked.forward = lambda x: F.linear(x, hooked.weight)  # as accelerate's offload hooks do
    flexpage.wrap(model)
    assert hooked not in flexpage.paged_state(model).linears.layers and hooked.forward.__name__ == "<lambda>"
    off = flexpage.wrap(zoo.build("llama-tiny"), few_row_linears=False)
    assert flexpage.paged_state(off).linears is None and all("forward" not in vars(m) for m in off.modules())
    elsewhere, here = torch.nn.Linear(4, 4, device="meta"), torch.nn.Linear(4, 4)  # off the CPU: left alone
    assert FewRowLinears(torch.nn.Sequential(elsewhere, here), lambda kwargs: True).layers == [here]
    assert "forward" not in vars(elsewhere)


@pytest.mark.parametrize("measured", [True, False])
def test_a_compiled_forward_takes_the_traceable_kernel_measured_fastest(fresh_choices, measured):
    """``wrap(compile_decode=True)`` measures first (``measure``): its traced decode forward then
    takes the fastest kernel inductor can trace (MKL's transposed form here: oneDNN's, faster, is
    eager-only); with nothing measured a trace times nothing and takes F.linear."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 24, bias=False))
    linears = FewRowLinears(model, lambda kwargs: True)
    if measured:
        linear.KERNELS["plain"] = _slowed(linear.KERNELS["plain"], 0.032)
        linear.KERNELS["transposed"] = _slowed(linear.KERNELS["transposed"], 0.016)
        linear.KERNELS["rows"] = _slowed(linear.KERNELS["rows"], 0.048)  # where it is built
        linears.measure(3)  # row buckets 1, 2, 4 of both weight shapes, each met once per sweep
        order = tuple(name for name in ("onednn", "transposed", "plain", "rows") if name in linear.candidates(False))
        assert linear.ranking == {(24, n, b, r, torch.get_num_threads(), "float32", False): order
                                  for n, b in ((16, True), (24, False)) for r in (1, 2, 4)}
        assert not linear.trials
    traced = []
    linear.KERNELS["transposed"] = lambda x, w, b: traced.append(x.shape) or transposed_linear(x, w, b)
    x = torch.randn(2, 16)
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, dynamic=False)(x)
    first, second = model
    ref = F.linear(F.linear(x.double(), first.weight.double(), first.bias.double()), second.weight.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert bool(traced) == measured
    assert len(linear.ranking) == (6 if measured else 0) and not linear.trials


@pytest.mark.parametrize("fastest", ["onednn_packed", "transposed"])
def test_a_compiled_forward_of_packed_layers_takes_the_kernel_measured_for_them(fresh_choices, fastest):
    """Where oneDNN on a packed copy measured fastest, a compiled forward calls it through the
    opaque op ``flexpage::packed_linear``, which finds the copy by the weight it is given: the
    graph's products equal F.linear's, and a weight changed in place is re-packed. Where another
    kernel measured fastest for the packed layers, the graph takes that one (not F.linear for want
    of a ranking of unpacked layers)."""
    from torch._inductor.utils import run_and_get_code

    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 24, bias=False))
    linears = FewRowLinears(model, lambda kwargs: True)
    linears.pack(4)
    for layer in model:  # decided at 2 rows, for the packed layers only
        others = tuple(name for name in linear.candidates(packed=True) if name != fastest)
        linear.ranking[linear.row_key(2, layer.weight, layer.bias, True)] = (fastest, *others)
    assert linears.traced_kernels(2) == (fastest, fastest)
    traced = []
    linear.KERNELS["transposed"] = lambda x, w, b: traced.append(x.shape) or transposed_linear(x, w, b)
    x = torch.randn(2, 16)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)

    def reference():
        first, second = model
        hidden = F.linear(x.double(), first.weight.double(), first.bias.double())
        return F.linear(hidden, second.weight.double())

    with torch.no_grad():
        out, code = run_and_get_code(compiled, x)
        assert ("packed_linear" in "\n".join(code)) == (fastest == "onednn_packed")
        assert len(traced) == (2 if fastest == "transposed" else 0)
        torch.testing.assert_close(out.double(), reference(), rtol=1e-5, atol=1e-5)
        model[1].weight.mul_(2)  # in place: the copy is taken again on the next call
        torch.testing.assert_close(compiled(x).double(), reference(), rtol=1e-5, atol=1e-5)
    linears.remove()


SHAPES = [((1, 512), 512, False), ((2, 64), 96, True), ((3, 100), 37, True), ((1, 5, 1536), 24, False),
          ((1, 47), 5, True), ((9, 64), 16, True)]  # tails of inputs (100, 47) and of outputs (37, 5)


@pytest.mark.parametrize("shape, out_features, bias", SHAPES)
@pytest.mark.parametrize("kernel", ["rows", "widened"])
def test_the_bfloat16_kernels_are_the_exact_product_rounded_once(monkeypatch, shape, out_features, bias, kernel):
    """The few-row kernel (dot products, or values widened in registers where the CPU has none) and
    ``widened_linear`` (float32 GEMMs over tiles widened in a scratch: forced small here, so a
    weight spans several and a last partial one, and one opaque op in a compiled forward)."""
    assert kernels.row_linear_available(torch.bfloat16)  # CI machines have AVX2 at least
    monkeypatch.setattr(linear, "WIDEN_TILE_BYTES", 4 * shape[-1] * 7)  # 7 features a tile
    product = linear.row_linear if kernel == "rows" else linear.widened_linear
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).bfloat16()
    weight = torch.randn(out_features, shape[-1], generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    out = product(x, weight, b)
    if kernel == "widened":
        traced = torch.compile(lambda x, w, b: linear.widened_linear(x, w, b) * 1, fullgraph=True)(x, weight, b)
        assert torch.equal(traced, out)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs()) + (0 if b is None else b.double().abs())
    assert out.shape == exact.shape and out.dtype == torch.bfloat16
    # float32 sums (their error a few float32 steps of the terms' magnitude), rounded to bfloat16 once
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * 2**-20).all()
    assert (out == F.linear(x, weight, b)).float().mean() >= 0.98  # oneDNN's float32 sums, rounded the same way
    columns = torch.randn(shape[-1], 7, generator=g).bfloat16().t()  # rows not contiguous
    assert torch.equal(product(columns, weight, b), product(columns.contiguous(), weight, b))
    assert out.is_contiguous()


@pytest.mark.parametrize("shape, out_features, bias", SHAPES)
def test_the_float32_kernel_is_the_exact_product_within_float32_sums(shape, out_features, bias):
    assert kernels.row_linear_available(torch.float32)  # CI machines have AVX2 at least
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    weight = torch.randn(out_features, shape[-1], generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    out = linear.row_linear(x, weight, b)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs()) + (0 if b is None else b.double().abs())
    assert out.shape == exact.shape and out.dtype == torch.float32
    assert ((out.double() - exact).abs() <= magnitude * (shape[-1] + 1) * 2**-24).all()  # float32 sums' bound
    columns = torch.randn(shape[-1], 7, generator=g).t()  # rows not contiguous
    assert torch.equal(linear.row_linear(columns, weight, b), linear.row_linear(columns.contiguous(), weight, b))


@pytest.mark.slow  # a subprocess
def test_the_ops_kernel_is_native_where_a_cxx_compiler_builds_it_else_python():
    """``flexpage::row_linear``, the op a compiled step calls: its C++ kernel where a C++ compiler
    builds it (no Python per call), bit-identical to the ``ctypes`` call for every dtype built;
    in a process whose C++ compiler fails, the same products through Python, and a warning."""
    assert "rows" in linear.candidates(False, torch.float32)  # the kernel is available, so the op has its kernel
    if kernels.cxx_compiler() is not None:
        assert linear.row_linear_kernel() is torch.ops.flexpage.row_linear.default
    g = torch.Generator().manual_seed(0)
    for dtype in (d for d in kernels.ROW_LINEARS if kernels.row_linear_available(d)):
        for shape, out_features, bias in SHAPES:
            x = torch.randn(*shape, generator=g).to(dtype)
            weight = torch.randn(out_features, shape[-1], generator=g).to(dtype)
            b = torch.randn(out_features, generator=g).to(dtype) if bias else None
            assert torch.equal(torch.ops.flexpage.row_linear(x, weight, b), kernels.row_linear(x, weight, b))
            assert torch.equal(linear.row_linear(x, weight, b), kernels.row_linear(x, weight, b))
    script = (
        "import torch\n"
        "from flexpage.core import kernels, linear\n"
        "assert 'rows' in linear.candidates(False, torch.float32)\n"
        "assert linear.row_linear_kernel() is kernels.row_linear\n"
        "x, w, b = torch.randn(3, 5, 64), torch.randn(24, 64), torch.randn(24)\n"
        "assert torch.equal(torch.ops.flexpage.row_linear(x, w, b), kernels.row_linear(x, w, b))\n"
        "print('python kernel')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=os.environ | {"CXX": "/bin/false"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "python kernel" and "could not be built" in done.stderr


def test_the_few_row_kernel_is_timed_for_the_dtypes_it_is_built_for_and_few_rows(monkeypatch):
    monkeypatch.setattr(linear, "_row_kernels", lambda: kernels.ROW_LINEARS[torch.bfloat16][1])  # bfloat16 only
    assert "rows" in linear.candidates(False, torch.bfloat16)
    assert "rows" not in linear.candidates(False, torch.float32)
    monkeypatch.setattr(linear, "_row_kernels", lambda: kernels.ROW_LINEARS[torch.float32][1])  # float32 only
    assert "rows" in linear.candidates(True, torch.float32) and "rows" not in linear.candidates(False, torch.bfloat16)
    assert "rows" in linear.candidates(False, torch.float32, linear.ROW_KERNEL_ROWS)
    assert "rows" not in linear.candidates(False, torch.float32, 2 * linear.ROW_KERNEL_ROWS)  # many rows: GEMMs only
    monkeypatch.undo()
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails: no library, no kernel
    assert not any(kernels.row_linear_available(dtype) for dtype in kernels.ROW_LINEARS)
    assert not {"rows"} & {*linear.candidates(False, torch.bfloat16), *linear.candidates(False, torch.float32)}
    for dtype in kernels.ROW_LINEARS:
        x, weight = torch.randn(2, 64, dtype=dtype), torch.randn(32, 64, dtype=dtype)
        with torch.no_grad():
            assert torch.equal(fast_linear(x, weight, None), F.linear(x, weight))  # the library GEMMs still serve


def test_a_bfloat16_paged_model_through_the_kernel_is_as_close_to_float32_as_stock_bfloat16(fresh_choices,
                                                                                            monkeypatch):
    """Every bfloat16 linear of a wrapped model's paged forwards by the kernel (the only candidate):
    its logits, teacher-forced on float32 stock's greedy tokens, stay as close to float32's as
    stock bfloat16's, and predict float32's next token as often."""
    used = []
    monkeypatch.setitem(linear.KERNELS, "rows", lambda x, w, b: used.append(x.numel() // x.shape[-1]) or
                        linear.row_linear(x, w, b))
    monkeypatch.setattr(linear, "candidates", lambda packed, dtype=torch.float32, bucket=1:
                        ("rows",) if dtype == torch.bfloat16 else ("plain",))
    exact, stock = zoo.build("llama-tiny"), zoo.build("llama-tiny", dtype=torch.bfloat16)
    model = flexpage.wrap(zoo.build("llama-tiny", dtype=torch.bfloat16), compile_decode=False)
    prompt = torch.randint(3, exact.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    tokens = exact.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                            pad_token_id=0)
    cache = PagedKVCache(model.config, page_size=16, num_pages=8, max_batch_size=1, dtype=torch.bfloat16)
    paged, seen = [], 0
    with torch.no_grad():
        for end in range(prompt.shape[1], tokens.shape[1]):  # the prompt, then one token at a time
            out = model(input_ids=tokens[:, seen:end], attention_mask=torch.ones(1, end, dtype=torch.long),
                        position_ids=torch.arange(seen, end)[None], **{cache_argument(model): cache})
            paged.append(out.logits[0, -1].float())
            seen = end
        want = exact(tokens).logits[0, prompt.shape[1] - 1 : -1]
        plain = stock(tokens).logits[0, prompt.shape[1] - 1 : -1].float()
    paged = torch.stack(paged)
    assert used.count(1) >= 23 * model.config.num_hidden_layers  # every decode token's layers
    assert (paged - want).abs().max() <= 1.5 * (plain - want).abs().max()
    agreement = (paged.argmax(-1) == tokens[0, prompt.shape[1]:]).float().mean()
    assert agreement >= (plain.argmax(-1) == tokens[0, prompt.shape[1]:]).float().mean() - 0.05


@pytest.mark.parametrize("onednn_bf16, native_bf16", [(False, False), (True, False), (True, True)])
def test_kernels_are_offered_by_what_the_cpu_tier_runs(monkeypatch, onednn_bf16, native_bf16):
    """oneDNN's bfloat16 product only where the tier and oneDNN have it (an AVX2-only CPU's oneDNN
    has none: offering it crashed the Engine); bfloat16 widened to float32 GEMMs only where the
    tier has no bfloat16 instructions; F.linear always; float32's candidates untouched."""
    monkeypatch.setattr(linear.cpu, "onednn_bf16", lambda: onednn_bf16)
    monkeypatch.setattr(linear.cpu, "native_bf16", lambda: native_bf16)
    for bucket in (1, 64):
        offered = linear.candidates(False, torch.bfloat16, bucket)
        assert "plain" in offered
        assert ("onednn" in offered) == (onednn_bf16 and "onednn" in linear.KERNELS)
        assert ("widened" in offered) == (not native_bf16)
        assert "widened" not in linear.candidates(False, torch.float32, bucket)
        assert "onednn" in linear.candidates(False, torch.float32, bucket) or "onednn" not in linear.KERNELS


def test_a_kernel_that_fails_while_timed_is_dropped_with_one_line_and_the_call_answers(fresh_choices, caplog):
    """A candidate that raises while it is timed (oneDNN without a primitive for the dtype) is
    logged once and ranked last, behind F.linear; the calls keep answering with the product."""
    def broken(x, weight, bias):
        raise RuntimeError("could not create a primitive descriptor\nmore detail")

    linear.KERNELS["transposed"] = broken
    weight = torch.randn(24, 16)
    with torch.no_grad(), caplog.at_level("WARNING", logger="flexpage.core.linear"):
        for _ in range(len(linear.KERNELS) * linear.TRIALS):
            x = torch.randn(2, 16)
            torch.testing.assert_close(fast_linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    key = (24, 16, False, 2, torch.get_num_threads(), "float32", False)
    order = linear.ranking[key]
    assert order[-1] == "transposed" and order.index("plain") < order.index("transposed")  # never run
    failures = [r for r in caplog.records if "transposed failed" in r.getMessage()]
    assert len(failures) == 1 and "more detail" not in failures[0].getMessage()
    linear.ranking.clear()
    linear.load_rankings()  # the next process takes the ranking, the failed kernel last
    assert linear.ranking[key] == order


def test_a_ranking_keeps_f_linear_first_unless_another_kernel_is_clearly_faster():
    """Medians decide, and a kernel displaces the stock product only by more than ``MARGIN``: one
    lucky call, or a difference within noise, never makes a step slower than the stock model's."""
    lucky = {"plain": [1.0, 1.0, 1.0, 1.0], "transposed": [0.5, 1.2, 1.3, 1.2], "rows": [0.98, 0.97, 0.99, 0.98]}
    assert linear.rank(lucky)[0] == "plain"  # transposed's best call and rows' 2% are no win
    clear = {"plain": [1.0, 1.1, 1.0, 0.9], "rows": [0.6, 0.7, 0.6, 0.65], "transposed": [2.0, 2.0, 2.0, 2.0]}
    assert linear.rank(clear) == ("rows", "plain", "transposed")
    assert linear.rank({"rows": [1.0], "widened": [0.5]}) == ("widened", "rows")  # no F.linear to keep


def test_rankings_of_another_tier_of_the_same_cpu_are_not_taken(fresh_choices, monkeypatch):
    """Rankings are keyed by what decides them (``cpu.signature``: tier, instruction sets, caches),
    not the CPU's marketing name: an AVX2-only EPYC does not take an AVX-512 EPYC's choices."""
    key = (8, 4, False, 2, torch.get_num_threads(), "float32", False)
    linear.ranking[key] = ("plain",)
    linear.save_rankings()
    linear.ranking.clear()
    monkeypatch.setattr(linear.cpu, "signature", lambda: "AMD EPYC | avx512_bf16 | flags 0 | L2 1024K")
    linear.load_rankings()
    assert linear.ranking == {}
    assert linear.cpu.tier() in linear.cpu.TIERS
