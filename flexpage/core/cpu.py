"""What this CPU can run: its instruction-set tier, decided once, which picks the kernels offered.

As llama.cpp's ggml-cpu picks kernels by what the CPU has, flexpage builds its C kernels for this
CPU's tier and offers a library kernel only where the tier and the torch build support it for the
dtype (oneDNN's bfloat16 products, say). ``FLEXPAGE_CPU_TIER`` makes flexpage act as on a CPU of a
lower tier than this one (tests run every tier the machine can); torch's own kernels follow
``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA``, which ``tier_environment`` sets beside it for a
child process.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TIER_ENV = "FLEXPAGE_CPU_TIER"
# lowest first; each tier has the ones before it
TIERS = ("baseline", "avx2", "avx512", "avx512_bf16")
# /proc/cpuinfo flags each tier needs (besides the lower tiers')
TIER_FLAGS = {"baseline": set(), "avx2": {"avx2", "fma", "f16c"},
              "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
              "avx512_bf16": {"avx512_bf16", "avx512_vnni"}}
# the compilers' -march of a tier forced below the CPU's own (the CPU's own tier builds for ``native``)
MARCH = {"baseline": "x86-64", "avx2": "haswell", "avx512": "skylake-avx512", "avx512_bf16": "cooperlake"}
# torch's own variables for a tier: ATen's vectorised kernels and oneDNN's instruction sets
ATEN_CAPABILITY = {"baseline": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512"}
ONEDNN_ISA = {"baseline": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16"}


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def model_name() -> str:
    """The CPU's model name (Linux; elsewhere what ``platform`` knows)."""
    return cpu_info().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags (x86 ``flags``, Arm ``Features``)."""
    info = cpu_info()
    return set((info.get("flags") or info.get("Features") or "").split())


@functools.cache
def detected_tier() -> str:
    """The highest tier whose flags this CPU has (``baseline`` off x86)."""
    flags, found = cpu_flags(), "baseline"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return found
    for tier in TIERS[1:]:
        if not TIER_FLAGS[tier] <= flags:
            break
        found = tier
    return found


@functools.cache
def tier() -> str:
    """The tier flexpage acts on: the CPU's own, or ``FLEXPAGE_CPU_TIER`` where it names a lower one
    (a higher one is ignored, with one logged line: its instructions would not run here)."""
    own, forced = detected_tier(), os.environ.get(TIER_ENV, "").strip().lower()
    if not forced:
        return own
    if forced not in TIERS:
        raise ValueError(f"{TIER_ENV}={forced!r}: expected one of {', '.join(TIERS)}")
    if TIERS.index(forced) > TIERS.index(own):
        log.warning("flexpage: %s=%s is above this CPU's tier (%s); acting on %s", TIER_ENV, forced, own, own)
        return own
    return forced


def has(wanted: str) -> bool:
    """Whether the tier flexpage acts on includes ``wanted`` (a name in ``TIERS``)."""
    return TIERS.index(tier()) >= TIERS.index(wanted)


def march() -> str:
    """The ``-march`` flexpage's C kernels are built for: ``native``, or the forced tier's."""
    current = tier()
    return "native" if current == detected_tier() else MARCH[current]


def onednn_bf16() -> bool:
    """Whether oneDNN's bfloat16 products run here: this torch's oneDNN says so and the tier is
    AVX-512 or above (oneDNN has no bfloat16 inner product below it)."""
    return (torch.backends.mkldnn.is_available() and has("avx512")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def native_bf16() -> bool:
    """Whether this tier multiplies bfloat16 in hardware (AVX512-BF16): elsewhere bfloat16
    products are float32 products of widened values, at float32's speed or below."""
    return has("avx512_bf16")


def _cache_sizes() -> str:
    """The first CPU's cache sizes by level (Linux sysfs), e.g. ``L1d 32K L2 1024K L3 32768K``."""
    sizes = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction":
            sizes.append(f"L{level}{'d' if kind == 'Data' else ''} {size}")
    return " ".join(sizes)


@functools.cache
def signature() -> str:
    """What decides which kernels win on this CPU, for keying measurements: its model name, the
    tier acted on, a digest of its instruction-set flags and its cache sizes (two CPUs that share
    a name but not their instructions are told apart)."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    return f"{model_name()} | {tier()} | flags {flags} | {_cache_sizes()}"


def tier_environment(forced: str) -> dict[str, str]:
    """Environment variables that make a new process act as on a CPU of tier ``forced``: flexpage's
    and torch's (ATen's kernels, oneDNN's instruction sets)."""
    return {TIER_ENV: forced, "ATEN_CPU_CAPABILITY": ATEN_CAPABILITY[forced], "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[forced]}


def available_tiers() -> tuple[str, ...]:
    """The tiers this CPU can act on (its own and those below it)."""
    return TIERS[:TIERS.index(detected_tier()) + 1]
