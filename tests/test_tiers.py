"""Every CPU tier, every dtype: flexpage acting on each instruction-set tier this machine can run
(``FLEXPAGE_CPU_TIER`` and torch's variables, in a process of its own) starts ``wrap`` and the
Engine in float32 and bfloat16 and gives stock's greedy tokens (float32: identical; bfloat16:
float32 stock predicts them as often as it predicts stock bfloat16's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexpage.core import cpu


@pytest.fixture
def fresh_tier(monkeypatch):
    """``cpu.tier`` decided afresh (it is cached per process)."""
    cpu.tier.cache_clear()
    cpu.signature.cache_clear()
    yield monkeypatch
    cpu.tier.cache_clear()
    cpu.signature.cache_clear()


def test_a_forced_tier_is_taken_below_the_cpu_and_refused_above_it(fresh_tier, caplog):
    own = cpu.detected_tier()
    fresh_tier.setenv(cpu.TIER_ENV, "baseline")
    assert cpu.tier() == "baseline" and not cpu.has("avx2") and not cpu.native_bf16() and not cpu.onednn_bf16()
    assert cpu.march() == ("native" if own == "baseline" else "x86-64")
    assert cpu.signature().split(" | ")[1] == "baseline"  # measurements of one tier are not another's
    cpu.tier.cache_clear()
    fresh_tier.setenv(cpu.TIER_ENV, "avx512_bf16")
    with caplog.at_level("WARNING", logger="flexpage.core.cpu"):
        assert cpu.tier() == own
    assert (own == "avx512_bf16") or "above this CPU's tier" in caplog.text
    cpu.tier.cache_clear()
    fresh_tier.setenv(cpu.TIER_ENV, "sse9")
    with pytest.raises(ValueError, match="FLEXPAGE_CPU_TIER='sse9': expected one of baseline"):
        cpu.tier()
    cpu.tier.cache_clear()
    fresh_tier.delenv(cpu.TIER_ENV)
    assert cpu.tier() == own and cpu.march() == "native"
    assert cpu.tier_environment("avx2") == {cpu.TIER_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2",
                                            "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_the_detected_tier_follows_the_instruction_sets(fresh_tier):
    """Each tier needs its flags and every lower tier's (an AVX-512 CPU without AVX512-BF16 is ``avx512``)."""
    cpu.detected_tier.cache_clear()
    try:
        for flags, expected in ((set(), "baseline"), ({"avx2", "fma", "f16c"}, "avx2"),
                                ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512"),
                                ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                                  "avx512_vnni"}, "avx512_bf16"),
                                ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}, "baseline")):
            fresh_tier.setattr(cpu, "cpu_flags", lambda flags=flags: flags)
            fresh_tier.setattr(cpu.platform, "machine", lambda: "x86_64")
            cpu.detected_tier.cache_clear()
            assert cpu.detected_tier() == expected, flags
    finally:
        cpu.detected_tier.cache_clear()


def run_tier(tier: str) -> dict:
    """``tier_worker.py``'s report from a process acting on ``tier``."""
    env = os.environ | cpu.tier_environment(tier)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("tier_worker.py"))], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.slow  # a process per tier, each compiling its own steps
@pytest.mark.parametrize("tier", cpu.available_tiers())
def test_wrap_and_the_engine_start_and_give_stocks_tokens_on_every_tier(tier):
    report = run_tier(tier)
    assert report["tier"] == tier
    assert report["march"] == ("native" if tier == cpu.detected_tier() else cpu.MARCH[tier])
    bf16 = report["candidates"]["bfloat16"]
    assert all("plain" in offered for offered in bf16)
    assert all(("widened" in offered) == (tier != "avx512_bf16") for offered in bf16)
    assert report["candidates"]["bfloat16_rows_kernel"] == report["candidates"]["float32_rows_kernel"] == (
        tier != "baseline")  # the few-row kernel from AVX2 on, bfloat16 widened where there are no dot products
    if tier in ("baseline", "avx2"):
        assert "onednn" not in bf16[0]  # no oneDNN bfloat16 below AVX-512: offering it crashed the Engine
    runs = report["runs"]
    for config in ("wrap", "engine"):
        assert runs["float32"][config]["tokens"] == runs["float32"]["stock"]["tokens"], config
        for ours, stocks in zip(runs["bfloat16"][config]["agreement"], runs["bfloat16"]["stock"]["agreement"]):
            assert ours >= stocks - 0.25, config  # 3 of 12 tokens: bfloat16's rounding, as stock's own
        assert sum(runs["bfloat16"][config]["agreement"]) >= 0.8 * len(runs["bfloat16"][config]["agreement"])
    assert runs["float32"]["compiled_steps"] > 0 and runs["bfloat16"]["compiled_steps"] > 0  # compiled steps ran
