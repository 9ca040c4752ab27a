"""Ahead-of-time compiled kernels (``flexpage.core.compile``): one graph per argument signature, saved
to disk and loaded by a later process; results always against eager (or SDPA) references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexpage.core.compile import compile_static

pytestmark = pytest.mark.slow  # servers, subprocesses or notebooks


def _shifted(x, mod):
    return mod(x) + 1


def _scale_by(factor):
    def scale(x):
        return x * factor

    return scale


class _Opaque:
    factor = 4.0


def _opaque_scale(x, obj):
    return x * obj.factor


def test_graphs_follow_argument_shapes_and_the_constants_mods_capture():
    shifted = compile_static(_shifted)
    x = torch.randn(8)
    assert torch.equal(shifted(x, _scale_by(2.0)), x * 2 + 1)
    assert torch.equal(shifted(x, _scale_by(2.0)), x * 2 + 1) and shifted.graphs == 1  # a new mod, same constant
    assert torch.equal(shifted(x, _scale_by(3.0)), x * 3 + 1) and shifted.graphs == 2  # a constant is baked in
    # a captured tensor is read afresh at every call: one graph for any values
    assert torch.equal(shifted(x, _scale_by(torch.tensor(2.0))), x * 2 + 1)
    assert torch.equal(shifted(x, _scale_by(torch.tensor(5.0))), x * 5 + 1) and shifted.graphs == 3
    y = torch.randn(3, 5)
    assert torch.equal(shifted(y, _scale_by(3.0)), y * 3 + 1) and shifted.graphs == 4
    with torch.inference_mode():  # grad modes are part of the signature, as dynamo guards them
        assert torch.equal(shifted(x, _scale_by(3.0)), x * 3 + 1) and shifted.graphs == 5
    # an argument a signature can't describe goes through dynamo (its guards), never a stale graph
    opaque = compile_static(_opaque_scale)
    obj = _Opaque()
    assert torch.equal(opaque(x, obj), x * 4)
    obj.factor = 6.0
    assert torch.equal(opaque(x, obj), x * 6) and opaque.graphs == 0


# One decode step of paged attention with a soft-capping score mod (a float and page-table
# tensors captured by the mods), checked against SDPA on the contiguous tensors.
# It also counts inductor's vector-ISA probes (a Python process each), fewer when loading saved graphs.
CHILD = r"""
import json, sys, torch
from torch._inductor import cpu_vec_isa
from attention_cases import run_case
from flexpage.core.compile import graph_counts
probes = []
probe = cpu_vec_isa.VecISA._probe_load
cpu_vec_isa.VecISA._probe_load = lambda self, path: probes.append(str(self)) or probe(self, path)
contexts = [[40, 1, 133], [7, 90, 16]][int(sys.argv[1])]
results = run_case("decode", 16, "softcap", torch.float32, 8, 2, contexts, [1, 1, 1], seed=int(sys.argv[1]))
print(json.dumps({"error": max((out - ref).abs().max().item() for out, ref in results), "isa_probes": len(probes),
                  **graph_counts()}))
"""


def test_a_later_process_loads_the_saved_kernels_and_compiles_nothing(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).parent))

    def child(seed: int) -> dict:
        out = subprocess.run([sys.executable, "-c", CHILD, str(seed)], env=env, capture_output=True, text=True,
                             timeout=600, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = child(0), child(1)  # other lengths and page placement in the second
    assert first["loaded"] == 0 and first["held"] == 2  # block metadata + attention, compiled
    assert second == {**second, "held": 2, "loaded": 2}  # both read from disk
    # loading trusts the CPU's flags for the base vector ISAs (some ISA-specific checks remain)
    assert second["isa_probes"] < first["isa_probes"]
    assert first["error"] <= 1e-5 and second["error"] <= 1e-5
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "flexpage").iterdir()) == ["_block_metadata",
                                                                                      "_flex_attention"]
