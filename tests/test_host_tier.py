"""The host tier's copies and slot bookkeeping: exact host slots, K/V equal after a round trip,
a full tier refusing whole write-backs, and the null tier holding nothing."""

import pytest
import torch

from radixserve.workers.mem_cache.host_tier import HostTier, NullHostTier
from radixserve.workers.mem_cache.kv_pool import KVPool


def device_pool(slots=16, page_size=1):
    pool = KVPool(2, 2, 3, slots, dtype=torch.float32, page_size=page_size)
    for layer, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
        n = k.shape[0]
        k.copy_(torch.arange(n * 6, dtype=torch.float32).view(n, 2, 3) + 1000 * layer)
        v.copy_(-k)
    return pool


def test_write_back_copies_every_layer_into_fresh_host_slots_and_load_brings_it_back():
    dev = device_pool()
    tier = HostTier(dev, 8)
    host = tier.write_back([3, 4, 5])
    assert host == [1, 2, 3]
    for layer in range(2):
        assert torch.equal(tier.pool.k_buffers[layer][host], dev.k_buffers[layer][[3, 4, 5]])
        assert torch.equal(tier.pool.v_buffers[layer][host], dev.v_buffers[layer][[3, 4, 5]])
    expected_k = [dev.k_buffers[layer][[3, 4, 5]].clone() for layer in range(2)]
    for buf in dev.k_buffers + dev.v_buffers:
        buf[9:12].zero_()
    tier.load(host, [9, 10, 11])
    for layer in range(2):
        assert torch.equal(dev.k_buffers[layer][9:12], expected_k[layer])
        assert torch.equal(dev.v_buffers[layer][9:12], -expected_k[layer])
    token_bytes = 2 * 2 * 2 * 3 * 4
    assert (tier.bytes_written, tier.bytes_loaded) == (3 * token_bytes, 3 * token_bytes)
    assert tier.available() == 5


def test_a_full_tier_allocates_nothing_and_freed_slots_are_reused_in_order():
    tier = HostTier(device_pool(), 4)
    assert tier.write_back([1, 2, 3]) == [1, 2, 3]
    assert tier.write_back([4, 5]) is None
    assert tier.available() == 1 and tier.bytes_written == 3 * tier.token_bytes
    tier.free([1, 2])
    assert tier.write_back([6, 7, 8]) == [4, 1, 2]
    assert tier.available() == 0


def test_pages_keep_their_offsets_on_the_host():
    dev = device_pool(slots=16, page_size=4)
    tier = HostTier(dev, 8)
    host = tier.write_back([8, 9, 10, 11, 12, 13])
    assert host == [4, 5, 6, 7, 8, 9]
    assert torch.equal(tier.pool.k_buffers[1][host], dev.k_buffers[1][[8, 9, 10, 11, 12, 13]])
    tier.free(host)
    assert tier.available() == 8


def test_load_refuses_mismatched_lengths():
    tier = HostTier(device_pool(), 4)
    host = tier.write_back([1, 2])
    with pytest.raises(ValueError, match="2 host slots for 1 device slots"):
        tier.load(host, [5])


def test_from_gb_sizes_the_tier_in_whole_tokens_and_zero_is_the_null_tier():
    dev = device_pool()
    token_bytes = 2 * 2 * 2 * 3 * 4
    tier = HostTier.from_gb(dev, 1e-6)
    assert isinstance(tier, HostTier)
    assert tier.size == int(1e-6 * (1 << 30)) // token_bytes
    null = HostTier.from_gb(dev, 0)
    assert isinstance(null, NullHostTier)
    assert (null.size, null.available(), null.write_back([1, 2])) == (0, 0, None)
    null.load([], [])
    with pytest.raises(AssertionError):
        null.load([1], [2])
