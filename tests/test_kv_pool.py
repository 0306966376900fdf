"""KVPool / ReqToTokenPool / memory sizing: exact slot ids, reuse order, and error paths."""

import pytest
import torch

from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.mem_cache.memory import machine_memory_bytes, max_tokens_for_memory
from radixserve.workers.mem_cache.req_to_token_pool import ReqToTokenPool


def make_pool(num_slots, page_size=1, layers=2):
    return KVPool(
        layers, num_kv_heads=3, head_dim=4, num_slots=num_slots, dtype=torch.float32, page_size=page_size
    )


def test_buffers_shape_dtype_and_size():
    pool = KVPool(3, 2, 8, num_slots=10, dtype=torch.bfloat16, page_size=4)
    assert pool.size == 8 and pool.page_size == 4 and pool.available() == 8
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    for buf in pool.k_buffers + pool.v_buffers:
        assert buf.shape == (14, 2, 8) and buf.dtype == torch.bfloat16
    assert pool.k_buffers[0].data_ptr() != pool.k_buffers[1].data_ptr()
    assert pool.k_buffers[0].data_ptr() != pool.v_buffers[0].data_ptr()


def test_fresh_pool_hands_out_ascending_and_reuses_fifo():
    pool = make_pool(8)
    assert pool.alloc(3) == [1, 2, 3]
    assert pool.alloc(2) == [4, 5]
    pool.free([2, 1])
    assert pool.available() == 5
    # Never-used slots first, then freed ones in the order they were freed.
    assert pool.alloc(5) == [6, 7, 8, 2, 1]
    assert pool.available() == 0
    assert pool.alloc(1) is None
    assert pool.alloc(0) == []


def test_alloc_failure_allocates_nothing():
    pool = make_pool(4)
    assert pool.alloc(5) is None
    assert pool.available() == 4
    assert pool.alloc(4) == [1, 2, 3, 4]


def test_free_accepts_tensor_and_rejects_double_free_and_slot0():
    pool = make_pool(8)
    slots = pool.alloc(4)
    pool.free(torch.tensor(slots[:2]))
    assert pool.available() == 6
    with pytest.raises(AssertionError, match="double free"):
        pool.free([1])
    with pytest.raises(AssertionError):
        pool.free([0])
    with pytest.raises(AssertionError):
        pool.free([9])
    with pytest.raises(ValueError):
        pool.alloc(-1)


def test_is_free_tracks_slots():
    pool = make_pool(4)
    assert pool.is_free(1) and not pool.is_free(0)
    (s,) = pool.alloc(1)
    assert not pool.is_free(s)
    pool.free([s])
    assert pool.is_free(s)


def test_paged_alloc_continues_last_page_then_fresh_pages():
    pool = make_pool(10, page_size=4)  # pages 1 and 2: slots 4..7 and 8..11
    assert pool.size == 8
    assert pool.alloc(3) == [4, 5, 6]
    assert pool.available() == 4
    assert pool.alloc(2, last_slot=6) == [7, 8]
    assert pool.available() == 0
    assert pool.alloc(1, last_slot=8) == [9]  # inside the request's own page: no new page
    assert pool.alloc(4, last_slot=9) is None  # 2 fit in the page, 2 would need a fresh page
    assert pool.alloc(2, last_slot=9) == [10, 11]
    assert pool.alloc(1, last_slot=11) is None  # page full, none free


def test_paged_last_slot_on_full_page_takes_fresh_page():
    pool = make_pool(16, page_size=4)
    assert pool.alloc(4) == [4, 5, 6, 7]
    assert pool.alloc(5, last_slot=7) == [8, 9, 10, 11, 12]
    assert pool.available() == 4


def test_paged_free_frees_whole_pages_fifo():
    pool = make_pool(16, page_size=4)
    a = pool.alloc(6)  # pages 1, 2
    b = pool.alloc(4)  # page 3
    assert a == [4, 5, 6, 7, 8, 9] and b == [12, 13, 14, 15]
    pool.free(a)  # pages 1 and 2, each once although page 1 appears four times
    assert pool.available() == 12
    assert pool.alloc(5) == [16, 17, 18, 19, 4]
    with pytest.raises(AssertionError, match="double free"):
        pool.free([10])  # page 2 is already free
    with pytest.raises(AssertionError):
        pool.free([3])  # the reserved first page
    with pytest.raises(AssertionError):
        pool.alloc(1, last_slot=9)  # page 2 does not belong to anyone


def test_bytes_per_token():
    assert KVPool.bytes_per_token(30, 3, 64, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert KVPool.bytes_per_token(2, 1, 8, torch.float32) == 2 * 2 * 1 * 8 * 4


def test_max_tokens_for_memory_explicit_total():
    assert max_tokens_for_memory(0.5, 100, 8, total_bytes=1000) == 50
    assert max_tokens_for_memory(0.5, 500, 8, total_bytes=1000) == 0
    assert max_tokens_for_memory(1.0, 0, 7, total_bytes=100) == 14
    with pytest.raises(ValueError, match="too small to hold the model weights"):
        max_tokens_for_memory(0.5, 501, 8, total_bytes=1000)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        max_tokens_for_memory(0.0, 1, 8, total_bytes=1000)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        max_tokens_for_memory(1.5, 1, 8, total_bytes=1000)
    with pytest.raises(ValueError, match="bytes_per_token"):
        max_tokens_for_memory(0.5, 1, 0, total_bytes=1000)


def test_machine_memory_is_bounded_by_meminfo():
    with open("/proc/meminfo") as f:
        mem_total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    total = machine_memory_bytes()
    assert 0 < total <= mem_total
    got = max_tokens_for_memory(0.5, 1 << 20, 1 << 10)
    assert got == (int(total * 0.5) - (1 << 20)) // (1 << 10)


def test_req_to_token_pool_rows():
    rp = ReqToTokenPool(3, 16)
    assert rp.table.shape == (3, 16) and rp.table.dtype == torch.int64
    assert [rp.alloc(), rp.alloc(), rp.alloc()] == [0, 1, 2]
    assert rp.alloc() is None and rp.available() == 0
    rp.free(1)
    rp.free(0)
    assert rp.available() == 2
    assert rp.alloc() == 1 and rp.alloc() == 0
    with pytest.raises(AssertionError, match="double free"):
        rp.free(2) or rp.free(2)
    with pytest.raises(AssertionError):
        rp.free(3)
