"""KV pools on transparent huge pages (flexpage.core.memory): zeroed, aligned, advised, freed."""

import gc
import mmap

import pytest
import torch

import flexpage
from flexpage.core import memory

linux_only = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="MADV_HUGEPAGE is Linux's")


def _mapping_flags(address: int) -> list[str] | None:
    """The VmFlags of this process's mapping that holds ``address`` (None: nothing mapped there)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


@linux_only
def test_a_large_cpu_tensor_is_zeroed_aligned_and_advised_onto_huge_pages():
    shape = (1, 2, 8200, 64)  # 4.2 MB: not a whole number of huge pages
    pool = memory.zeros(shape, torch.float32, "cpu")
    assert pool.shape == shape and pool.dtype == torch.float32 and pool.is_contiguous() and pool._base is None
    assert pool.data_ptr() % memory.HUGE_PAGE == 0
    assert torch.equal(pool, torch.zeros(shape))
    assert "hg" in _mapping_flags(pool.data_ptr())  # MADV_HUGEPAGE, whatever the system then makes of it
    slots = torch.tensor([0, 4099, 8199])
    states = torch.randn(1, 2, 3, 64)
    pool.index_copy_(2, slots, states)
    assert torch.equal(pool[:, :, slots], states)
    pool[:, :, slots] = 0
    assert not pool.any()  # nothing else written


@linux_only
def test_the_mapping_lives_as_long_as_a_view_of_it():
    pool = memory.zeros((1, 2, 16400, 64), torch.bfloat16, "cpu")
    address = pool.data_ptr()
    view = pool[:, 1]
    view.fill_(3)
    del pool
    gc.collect()
    assert "hg" in _mapping_flags(address) and view.eq(3).all()
    del view
    gc.collect()
    flags = _mapping_flags(address)
    assert flags is None or "hg" not in flags  # unmapped (or the address reused by another mapping)


@linux_only
def test_advice_the_kernel_refuses_leaves_ordinary_zeroed_memory(monkeypatch):
    monkeypatch.setattr(memory, "_ADVICE", 1 << 20)  # no such advice: madvise fails with EINVAL
    pool = memory.zeros((1, 2, 8200, 64), torch.float32, "cpu")
    assert torch.equal(pool, torch.zeros(pool.shape)) and "hg" not in _mapping_flags(pool.data_ptr())
    pool[0, 1, 8199] = 1.0
    assert pool.sum() == 64


def test_small_tensors_and_other_devices_are_plain_zeros():
    small = memory.zeros((4, 64), torch.float16, "cpu")
    assert small.dtype == torch.float16 and torch.equal(small, torch.zeros(4, 64, dtype=torch.float16))
    assert small.untyped_storage().resizable()  # torch's own allocation, not a mapping
    meta = memory.zeros((1, 2, 1 << 20, 64), torch.float32, "meta")
    assert meta.device.type == "meta" and meta.shape == (1, 2, 1 << 20, 64)


@linux_only
def test_a_cpu_cache_keeps_its_pools_on_advised_huge_pages():
    cache = flexpage.PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=64, page_size=64, num_pages=256,
                                  max_batch_size=4)
    pools = [pool for layer in cache.layers for pool in (layer.keys, layer.values)]
    assert len({pool.data_ptr() for pool in pools}) == 4
    for pool in pools:
        assert pool.data_ptr() % memory.HUGE_PAGE == 0 and "hg" in _mapping_flags(pool.data_ptr())
        assert not pool.any()
