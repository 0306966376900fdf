"""The disk tier: K/V equal after a spill and a fetch (bf16 included), the byte budget, and every
failure (budget spent, directory removed, corrupt or truncated file) answered with None / False,
a warning line and no file left behind, never with wrong K/V."""

import logging
import os
import shutil

import torch

from radixserve.workers.mem_cache.disk_tier import DiskTier
from radixserve.workers.mem_cache.kv_pool import KVPool


def pool(dtype=torch.float32, slots=8):
    p = KVPool(2, 2, 3, slots, dtype=dtype)
    for i, buf in enumerate(p.k_buffers + p.v_buffers):
        n = buf.shape[0]
        buf.copy_((torch.arange(n * 6).view(n, 2, 3) + 100 * i).to(dtype))
    return p


def zero(p):
    for buf in p.k_buffers + p.v_buffers:
        buf.zero_()


def test_spill_and_fetch_round_trip_every_layer(tmp_path):
    for dtype in (torch.float32, torch.bfloat16):
        src, dst = pool(dtype), pool(dtype)
        zero(dst)
        disk = DiskTier(str(tmp_path / str(dtype)), 1 << 20)
        key = disk.spill(src, [2, 3, 4])
        assert key == 1 and disk.keys() == [1]
        assert disk.fetch(key, dst, [5, 6, 7])
        for s, d in zip(src.k_buffers + src.v_buffers, dst.k_buffers + dst.v_buffers):
            assert torch.equal(d[[5, 6, 7]], s[[2, 3, 4]])
            assert not d[[1, 2, 3, 4, 8]].any()
        payload = 4 * 3 * 6 * dtype.itemsize
        assert disk.used_bytes == disk.bytes_written == disk.bytes_read == 40 + payload


def test_the_budget_refuses_a_spill_and_drop_gives_the_bytes_back(tmp_path):
    src = pool()
    size = 40 + 4 * 2 * 6 * 4
    disk = DiskTier(str(tmp_path), 2 * size)
    a, b = disk.spill(src, [1, 2]), disk.spill(src, [3, 4])
    assert (a, b) == (1, 2)
    assert disk.spill(src, [5, 6]) is None
    assert sorted(os.listdir(tmp_path)) == ["1.kv", "2.kv"]
    disk.drop(a)
    assert disk.used_bytes == size and sorted(os.listdir(tmp_path)) == ["2.kv"]
    assert disk.spill(src, [5, 6]) == 3
    assert not disk.fetch(a, src, [1, 2])  # a dropped key is gone


def test_a_removed_directory_fails_spill_and_fetch_with_a_log_line(tmp_path, caplog):
    src, dst = pool(), pool()
    zero(dst)
    disk = DiskTier(str(tmp_path / "kv"), 1 << 20)
    key = disk.spill(src, [1, 2])
    shutil.rmtree(tmp_path / "kv")
    with caplog.at_level(logging.WARNING):
        assert not disk.fetch(key, dst, [3, 4])
        assert disk.spill(src, [1, 2]) is None
    assert not dst.k_buffers[0].any()
    assert disk.keys() == [] and disk.used_bytes == 0 and disk.failures == 2
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"disk tier: file {key} unreadable",
        "disk tier: spill of 2 tokens failed",
    ]


def test_a_corrupt_or_truncated_file_fails_its_checksum_and_is_forgotten(tmp_path, caplog):
    src, dst = pool(), pool()
    zero(dst)
    disk = DiskTier(str(tmp_path), 1 << 20)
    a, b = disk.spill(src, [1, 2]), disk.spill(src, [3, 4])
    path = tmp_path / f"{a}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    (tmp_path / f"{b}.kv").write_bytes(path.read_bytes()[:50])
    with caplog.at_level(logging.WARNING):
        assert not disk.fetch(a, dst, [5, 6])
        assert not disk.fetch(b, dst, [5, 6])
    assert not dst.k_buffers[0].any() and not dst.v_buffers[1].any()
    assert "checksum mismatch" in caplog.records[0].getMessage()
    assert disk.keys() == [] and os.listdir(tmp_path) == [] and disk.used_bytes == 0


def test_a_range_of_a_file_is_read_and_a_range_past_its_end_refused(tmp_path):
    src, dst = pool(), pool()
    zero(dst)
    disk = DiskTier(str(tmp_path), 1 << 20)
    key = disk.spill(src, [1, 2, 3])
    assert disk.fetch(key, dst, [6], offset=1)  # the file's second token only
    for s, d in zip(src.k_buffers + src.v_buffers, dst.k_buffers + dst.v_buffers):
        assert torch.equal(d[6], s[2]) and not d[[1, 2, 3, 5, 7]].any()
    assert not disk.fetch(key, dst, [5, 6], offset=2)  # tokens 2..3 of a 3-token file
    assert disk.keys() == []  # refused, and forgotten
