"""flexpage's C decode kernel (``flexpage.core.kernels``): one decode token's attention over pages
read in place, against SDPA over the same values; its fallback where it cannot be built; and
greedy tokens equal to stock's when every decode token takes it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import flexpage
from flexpage import zoo
from flexpage.core import attention, kernels, policy, quant
from flexpage.core.attention import sequence_attention
from flexpage.core.masks import SequenceKV, run_arrays
from reference import make_cache, stock_greedy, workload

POOLS = [torch.int8, torch.float8_e4m3fn, torch.float32, torch.bfloat16]


def stored(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``states`` as a pool of ``dtype`` stores them (quantised with their scales, or cast)."""
    return quant.quantise(states, dtype) if dtype in quant.QUANTISED else states.to(dtype)


def values_of(pool: torch.Tensor) -> torch.Tensor:
    """The float32 values a pool holds."""
    return quant.dequantise(pool, torch.float32) if quant.is_quantised(pool) else pool.float()


def int8_products(values: torch.Tensor) -> dict:
    """How close the kernel's output over int8 pages is to float arithmetic's, where it takes integer
    products (the query in two int8 steps: 2^-15 of its largest value; each block's weights in
    16-bit steps): far closer than int8's own rounding (2^-8 of a token's largest value)."""
    return {"atol": 2 ** -12 * values.abs().max().item(), "rtol": 2 ** -12}


def kernel_tolerance(values: torch.Tensor, query_dtype: torch.dtype, pool_dtype: torch.dtype) -> dict:
    """``assert_close``'s tolerance for the kernel's output against float64 arithmetic: a bfloat16
    query's output is rounded to bfloat16 (half a step: 2^-9), and over bfloat16 pages its
    probabilities may be too (each value's weight off by 2^-9); int8 pages' integer products."""
    if query_dtype != torch.float32:
        return {"atol": 2 ** -9 * values.abs().max().item(), "rtol": 2 ** -8}
    return int8_products(values) if pool_dtype == torch.int8 else {}


@pytest.mark.parametrize("dtype", POOLS)
# every count of query heads a KV head's last group of four can hold (1-4) over the vector paths
# (head dims 64 and 128; 256, int8 pages' widest integer sums), and the narrower and odd head dims' paths
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 64), (4, 4, 128), (4, 2, 128), (6, 2, 64), (6, 2, 24),
                                                  (16, 1, 32), (4, 2, 20), (8, 2, 256)])
def test_the_decode_kernel_attends_pages_in_place_as_sdpa_over_their_values(monkeypatch, dtype, heads, kv_heads,
                                                                           dim):
    assert kernels.compiler() is not None and kernels.library() is not None  # CI machines have a C compiler
    torch.manual_seed(0)
    key_pool = stored(torch.randn(1, kv_heads, 700, dim) * 3, dtype)
    value_pool = stored(torch.randn(1, kv_heads, 700, dim), dtype)
    monkeypatch.setattr(kernels, "PART_KEYS", 40)  # several parts per head, none a whole block of keys
    for query_dtype, cap in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, 2.0)):
        query = torch.randn(1, heads, 1, dim, dtype=query_dtype)
        for runs in [((5, 1),), ((0, 33),), ((640, 50), (3, 300), (400, 37))]:
            got = kernels.decode_attention(query, key_pool, value_pool, *run_arrays([runs]), scale=0.3, cap=cap)
            slots = torch.cat([torch.arange(start, start + count) for start, count in runs])
            keys, values = (values_of(pool[:, :, slots]).double() for pool in (key_pool, value_pool))
            if cap is None:
                want = F.scaled_dot_product_attention(query.double(), keys, values, scale=0.3, enable_gqa=True).float()
            else:  # soft-capped (Gemma 2), which SDPA has not: scores of a few units pass through tanh's bend
                scores = query.double() @ keys.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) * 0.3
                probs = (cap * torch.tanh(scores / cap)).softmax(-1)
                want = (probs @ values.repeat_interleave(heads // kv_heads, 1)).float()
            assert got.dtype == query_dtype and got.shape == want.shape
            values = values_of(value_pool[:, :, slots])
            torch.testing.assert_close(got.float(), want, **kernel_tolerance(values, query_dtype, dtype))


def test_without_a_compiler_decode_tokens_fall_back_to_sdpa_over_dequantised_keys(monkeypatch, caplog):
    torch.manual_seed(0)
    cache = make_cache(16, 8, 2, 64, kv_dtype="int8")
    keys, values = cache.layers[0].keys, cache.layers[0].values
    keys[:, :, :40] = quant.quantise(torch.randn(1, 2, 40, 64), torch.int8)
    values[:, :, :40] = quant.quantise(torch.randn(1, 2, 40, 64), torch.int8)
    kv = SequenceKV(40, None, torch.arange(40).flip(0))  # gathered in reverse: 40 runs of one key
    query = torch.randn(1, 8, 1, 64)
    want = F.scaled_dot_product_attention(query, values_of(keys[:, :, kv.slots]), values_of(values[:, :, kv.slots]),
                                          enable_gqa=True)
    for cc in (None, "/bin/false"):  # the machine's compiler, then one that fails to build
        if cc is not None:
            monkeypatch.setenv("CC", cc)
        torch.testing.assert_close(sequence_attention(query, keys, values, kv), want,
                                   **int8_products(values_of(values[:, :, :40])))
    assert kernels.decode_attention(query, keys, values, *run_arrays([kv.key_runs()])) is None
    assert "the C kernel decode_attention could not be built" in caplog.text


@pytest.mark.parametrize("native", [True, False])
def test_generate_with_every_decode_token_through_the_kernel_equals_stock(monkeypatch, stock_llama, native):
    """Every decode token over float32 pages by the kernel: through C++ (``flexpage::paged_decode``,
    where the C++ ops build), or else through ``ctypes`` (the lone token's threshold lowered). A
    padded batch of two (one kernel call per layer for both rows), then each prompt alone, give
    stock's greedy tokens, and every decode step's layers ran it."""
    calls = []
    if native:
        assert kernels.native_ops()
        through = attention._paged_decode

        def counted(query, *args, **kwargs):
            calls.append(query.shape[2])  # the decode tokens of the call
            return through(query, *args, **kwargs)

        monkeypatch.setattr(attention, "_paged_decode", counted)
    else:
        monkeypatch.setattr(attention, "native_ops_loaded", lambda: False)
        monkeypatch.setattr(policy, "CPU_POLICY", dataclasses.replace(policy.CPU_POLICY, lone_decode_kernel_keys=1))

        def counted(*args, **kwargs):
            calls.append(args[0].shape[0])  # the decode tokens of the call
            return kernels.decode_attention(*args, **kwargs)

        monkeypatch.setattr(attention, "decode_attention", counted)
    model = flexpage.wrap(zoo.build("llama-tiny"), compile_decode=False, max_batch_size=2)
    prompts = workload((40, 13))
    ids = torch.tensor([[0] * 27 + prompts[1], prompts[0]])
    out = model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out[:, 40:].tolist() == [stock_greedy(stock_llama, prompt, 12) for prompt in prompts[::-1]]
    layers = stock_llama.config.num_hidden_layers
    assert calls.count(2) == 11 * layers  # both rows in one call, every decode step
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == stock_greedy(stock_llama, prompt, 12)
    assert calls.count(1) == 2 * 11 * layers


def test_loading_the_kernels_leaves_the_process_floating_point_modes_alone():
    """Subnormal floats still exist after both libraries are loaded (a library linked with
    -ffast-math turns on flush-to-zero for the whole process when it loads)."""
    assert kernels.library("decode_attention") is not None
    assert kernels.library("row_linear") is not None
    tiny = torch.tensor([1e-39]) * torch.tensor([1.0])  # a subnormal float32, computed after the load
    assert tiny.item() != 0.0 and tiny.item() == pytest.approx(1e-39, rel=1e-3)


@pytest.mark.parametrize("dtype", POOLS)
def test_paged_decode_attends_each_tokens_keys_through_the_page_table_as_sdpa(dtype):
    """``flexpage::paged_decode`` (a static decode step's attention, C++): each token attends its
    row's keys up to its position (within a window), found through the page table in scattered
    pages, as SDPA over those keys' values; a speculating row's several tokens each see their own
    prefix; padding tokens (position -1) get zeros."""
    assert kernels.native_ops()  # CI machines have C and C++ compilers
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 16, 8, 2, 64
    key_pool = stored(torch.randn(1, kv_heads, 40 * page, dim) * 3, dtype)
    value_pool = stored(torch.randn(1, kv_heads, 40 * page, dim), dtype)
    table = torch.full((3, 10), -1, dtype=torch.int32)
    table[0, :9] = torch.tensor([7, 8, 9, 30, 2, 3, 4, 20, 21])  # runs across page boundaries and gaps
    table[2, :2] = torch.tensor([11, 5])
    tok_rows = torch.tensor([0, 0, 2, 0, 1])
    tok_pos = torch.tensor([140, 138, 20, 3, -1])
    for query_dtype, window, cap in ((torch.float32, 0, 0.0), (torch.bfloat16, 0, 0.0), (torch.float32, 40, 2.0)):
        query = torch.randn(1, heads, len(tok_pos), dim, dtype=query_dtype)
        got = torch.ops.flexpage.paged_decode(query, key_pool, value_pool, table, tok_rows, tok_pos, page, window,
                                              0.3, cap)
        assert got.dtype == query_dtype and got.shape == query.shape
        assert torch.equal(got[:, :, 4], torch.zeros_like(got[:, :, 4]))
        for t, (row, pos) in enumerate(zip(tok_rows.tolist(), tok_pos.tolist())):
            if pos < 0:
                continue
            positions = torch.arange(max(0, pos - window + 1) if window else 0, pos + 1)
            slots = table[row, positions // page].long() * page + positions % page
            keys, values = (values_of(pool[:, :, slots]).double().repeat_interleave(heads // kv_heads, 1)
                            for pool in (key_pool, value_pool))
            scores = query[:, :, t : t + 1].double() @ keys.transpose(-1, -2) * 0.3
            want = ((cap * torch.tanh(scores / cap) if cap else scores).softmax(-1) @ values).float()
            values = values_of(value_pool[:, :, slots])
            torch.testing.assert_close(got[:, :, t : t + 1].float(), want,
                                       **kernel_tolerance(values, query_dtype, dtype))


def test_paged_decode_is_a_well_formed_op():
    """``opcheck``: its shape function agrees with the kernel (contiguous output of the query's
    shape, for a query of a forward's strides), and it traces and dispatches as a custom op should."""
    assert kernels.native_ops()
    torch.manual_seed(0)
    pool = torch.randn(1, 2, 64, 32)
    query = torch.randn(1, 3, 4, 32).transpose(1, 2)  # [1, heads, tokens, dim] as a forward transposes it
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    args = (query, pool, pool.clone(), table, torch.tensor([1, 0, 0]), torch.tensor([20, 5, -1]), 16, 0, 0.2, 0.0)
    torch.library.opcheck(torch.ops.flexpage.paged_decode.default, args)


def test_paged_decode_refuses_tokens_outside_the_page_table():
    """A token whose row holds no page at a position it reads raises, naming the token, rather
    than reading another sequence's keys."""
    assert kernels.native_ops()
    pool = torch.randn(1, 2, 64, 32)
    table = torch.tensor([[1, -1]], dtype=torch.int32)
    query = torch.randn(1, 4, 1, 32)
    with pytest.raises(RuntimeError, match="token 0 reads a page its row does not hold"):
        torch.ops.flexpage.paged_decode(query, pool, pool, table, torch.tensor([0]), torch.tensor([20]), 16, 0, 1.0, 0.0)


def _pid_written_then_sleeping(path) -> list[str]:
    """A command that writes its process id to ``path`` and then sleeps for a minute."""
    return [sys.executable, "-c", f"import os, time; open({str(path)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]


def _wait_for_pid(path) -> int:
    deadline = time.monotonic() + 20
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.01)
    return int(path.read_text())


def _running_children() -> set[int]:
    """This process's children that have not exited (Linux's /proc)."""
    children = set()
    for entry in os.listdir("/proc"):
        try:
            fields = (Path("/proc") / entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            children.add(int(entry))
    return children


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_a_build_command_that_cannot_start_stops_those_already_started(tmp_path):
    before = _running_children()
    with pytest.raises(FileNotFoundError):
        kernels.run_commands(_pid_written_then_sleeping(tmp_path / "pid"), [str(tmp_path / "no-such-compiler")])
    assert _running_children() <= before


def test_build_commands_past_their_time_are_stopped_and_reported(tmp_path):
    marker = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(subprocess.CalledProcessError) as failed:
        kernels.run_commands(_pid_written_then_sleeping(marker), timeout=3)
    assert time.monotonic() - start < 30 and failed.value.returncode < 0  # killed, not waited out
    with pytest.raises(ProcessLookupError):
        os.kill(_wait_for_pid(marker), 0)
