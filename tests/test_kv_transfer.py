"""KV transfer over per-pair gloo process groups, between replicas in separate processes (Ray
actors): exact K/V equality, suffix-only transfers, concurrency on one pair and across pairs,
handshake refusals, cancellation, deadlines, and peers that die or stall mid-transfer."""

from __future__ import annotations

import os
import signal

import pytest
import ray
import torch

from tests import kv_transfer_utils
from tests.kv_transfer_utils import (
    LAYERS,
    SPEC_MISMATCHES,
    TEST_CONFIG,
    KVPeer,
    assert_moved,
    free,
    move,
    tid,
    token_layer_bytes,
    wait_for,
)

# Each module brings up a local Ray instance and several actor processes (about a minute).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(kv_transfer_utils)
    yield ray.remote(num_cpus=0, max_concurrency=16)(KVPeer)
    ray.shutdown()


@pytest.fixture(scope="module")
def pair(cluster):
    p0, d0 = cluster.remote("p0"), cluster.remote("d0")
    yield p0, d0
    ray.get([p0.close.remote(), d0.close.remote()])


@pytest.fixture(autouse=True)
def idle_after(request):
    """Every transfer a test starts on the shared pair has settled when it ends."""
    yield
    if "pair" in request.fixturenames:
        p0, d0 = request.getfixturevalue("pair")
        for peer in (p0, d0):
            assert ray.get(peer.stats.remote())["open"] == {"sending": 0, "receiving": 0}


@pytest.mark.parametrize("mode", ["all", "layers", "chunks"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_received_kv_equals_sent_kv(pair, dtype, page_size, mode):
    p0, d0 = pair
    name = f"{dtype}-{page_size}"
    ray.get(
        [
            p0.ensure_engine.remote(name, f"p0-{name}", dtype=dtype, page_size=page_size),
            d0.ensure_engine.remote(name, f"d0-{name}", dtype=dtype, page_size=page_size),
        ]
    )
    sent0 = ray.get(p0.stats.remote(name))["total"]
    before = ray.get(d0.whole_pool.remote(name))
    src, dst, _ = move(p0, d0, 37, mode=mode, chunk=16, engine=name)
    assert_moved(p0, d0, src, dst, before, name)
    sent = ray.get(p0.stats.remote(name))["total"]
    assert sent["bytes_sent"] - sent0["bytes_sent"] == 37 * LAYERS * token_layer_bytes(dtype)
    assert sent["transfers_sent"] - sent0["transfers_sent"] == 1
    # Layers queued faster than the pair sends them merge into fewer payloads (never across chunks).
    fewest, most = {"all": (1, 1), "layers": (1, LAYERS), "chunks": (3, 3 * LAYERS)}[mode]
    assert fewest <= sent["payloads_sent"] - sent0["payloads_sent"] <= most
    free(p0, d0, src, dst, name)


def test_whole_request_send_is_cut_at_max_message_bytes(pair):
    p0, d0 = pair
    # 37 tokens x 96 bytes per layer > 1000: ten tokens of one layer per payload.
    small = {"config": {"max_message_bytes": 1000}}
    ray.get(
        [p0.ensure_engine.remote("small", "p0-small", **small), d0.ensure_engine.remote("small", "d0-small")]
    )
    before = ray.get(d0.whole_pool.remote("small"))
    src, dst, _ = move(p0, d0, 37, engine="small")
    assert_moved(p0, d0, src, dst, before, "small")
    assert ray.get(p0.stats.remote("small"))["total"]["payloads_sent"] == LAYERS * 4
    free(p0, d0, src, dst, "small")


def test_suffix_only_moves_the_pages_the_receiver_lacks(pair):
    p0, d0 = pair
    s0, r0 = ray.get(p0.stats.remote())["peers"].get("d0"), ray.get(d0.stats.remote())["peers"].get("p0")
    before = ray.get(d0.whole_pool.remote())
    src, dst, _ = move(p0, d0, 50, held=20, mode="layers")
    assert len(src) == len(dst) == 30
    assert_moved(p0, d0, src, dst, before)
    s1, r1 = ray.get(p0.stats.remote())["peers"]["d0"], ray.get(d0.stats.remote())["peers"]["p0"]
    tlb = token_layer_bytes()
    for old, new, moved in ((s0, s1, "bytes_sent"), (r0, r1, "bytes_received")):
        old = old or {moved: 0, "bytes_saved": 0}
        assert new[moved] - old[moved] == 30 * LAYERS * tlb
        assert new["bytes_saved"] - old["bytes_saved"] == 20 * LAYERS * tlb
    free(p0, d0, src, dst)


def test_concurrent_transfers_on_one_pair(pair):
    p0, d0 = pair
    opened = ray.get(p0.stats.remote())["peers"]["d0"]["pairs_opened"]
    before = ray.get(d0.whole_pool.remote())
    sizes = [5, 17, 1, 33, 8, 21]
    srcs = [ray.get(p0.alloc.remote(n)) for n in sizes]
    dsts = [ray.get(d0.alloc.remote(n)) for n in sizes]
    ids = [tid() for _ in sizes]
    tickets = [ray.get(d0.expect.remote(t, dst)) for t, dst in zip(ids, dsts)]
    # Six transfers interleaved layer by layer from one thread, and three more from three threads.
    refs = [p0.send_interleaved.remote(tickets, srcs)]
    extra = [(ray.get(p0.alloc.remote(9)), ray.get(d0.alloc.remote(9)), tid()) for _ in range(3)]
    for src, dst, t in extra:
        refs.append(p0.send.remote(ray.get(d0.expect.remote(t, dst)), src, "layers"))
    ray.get(refs)
    for t in ids + [t for _, _, t in extra]:
        assert ray.get(d0.outcome.remote(t)) == "" and ray.get(p0.outcome.remote(t)) == ""
    all_src = [s for src in srcs for s in src] + [s for src, _, _ in extra for s in src]
    all_dst = [s for dst in dsts for s in dst] + [s for _, dst, _ in extra for s in dst]
    assert_moved(p0, d0, all_src, all_dst, before)
    assert ray.get(p0.stats.remote())["peers"]["d0"]["pairs_opened"] == opened
    free(p0, d0, all_src, all_dst)


def test_many_pairs_at_once(cluster, pair):
    p0, d0 = pair
    p1, d1 = cluster.remote("p1"), cluster.remote("d1")
    routes = [(p, d) for p in (p0, p1) for d in (d0, d1)]
    befores = {d: ray.get(d.whole_pool.remote()) for d in (d0, d1)}
    jobs, refs = [], []
    for p, d in routes:
        for n in (7, 19):
            src, dst, t = ray.get(p.alloc.remote(n)), ray.get(d.alloc.remote(n)), tid()
            refs.append(p.send.remote(ray.get(d.expect.remote(t, dst)), src, "layers"))
            jobs.append((p, d, src, dst, t))
    ray.get(refs)
    for p, d, src, dst, t in jobs:
        assert ray.get(d.outcome.remote(t)) == "" and ray.get(p.outcome.remote(t)) == ""
        assert torch.equal(ray.get(d.read.remote(dst)), ray.get(p.read.remote(src)))
    for d in (d0, d1):
        rows = [s for _, dd, _, dst, _ in jobs if dd is d for s in dst]
        after = ray.get(d.whole_pool.remote())
        keep = torch.ones(after.shape[2], dtype=torch.bool)
        keep[rows] = False
        assert torch.equal(after[:, :, keep], befores[d][:, :, keep])
    assert set(ray.get(p1.stats.remote())["peers"]) == {"d0", "d1"}
    assert {"p0", "p1"} <= set(ray.get(d1.stats.remote())["peers"])
    for p, d, src, dst, _ in jobs:
        free(p, d, src, dst)
    ray.get([p1.close.remote(), d1.close.remote()])


@pytest.mark.parametrize(
    ("field", "kwargs", "theirs", "ours"), SPEC_MISMATCHES, ids=[m[0] for m in SPEC_MISMATCHES]
)
def test_handshake_mismatch_is_refused_naming_the_field_on_both_sides(pair, field, kwargs, theirs, ours):
    p0, d0 = pair
    sender = f"p-{field}"
    ray.get(p0.ensure_engine.remote(field, sender, **kwargs))
    src, dst, t = ray.get(p0.alloc.remote(6, field)), ray.get(d0.alloc.remote(6)), tid()
    ticket = ray.get(d0.expect.remote(t, dst))
    ray.get(p0.send.remote(ticket, src, "all", 0, field))
    error = ray.get(p0.outcome.remote(t))
    assert error.startswith(f"HandshakeMismatch: transfer {t!r}: KV transfer handshake refused: ")
    assert f"{field}: prefill replica {sender!r} has {theirs!r}, decode replica 'd0' has {ours!r}" in error
    assert ray.get(p0.error_fields.remote(t)) == {field: (theirs, ours)}
    assert (
        f"{field}: decode replica 'd0' has {ours!r}, prefill replica {sender!r} has {theirs!r}"
        in ray.get(d0.refusals.remote())[-1]
    )
    assert ray.get(d0.stats.remote())["peers"][sender]["handshakes_refused"] == 1
    # The refused sender never touched the receiver's transfer: it is still waiting.
    assert ray.get(d0.outcome.remote(t, 0.2)) == "pending"
    assert ray.get(d0.cancel.remote(t))
    ray.get([p0.free.remote(src, field), d0.free.remote(dst)])


def test_transport_mismatch_is_refused_before_connecting(pair):
    p0, d0 = pair
    ray.get(p0.ensure_engine.remote("nccl", "p-nccl", spec_overrides={"transport": "nccl"}))
    ticket = ray.get(d0.expect.remote(t := tid(), ray.get(d0.alloc.remote(3))))
    with pytest.raises(ray.exceptions.RayTaskError, match="the receiver uses 'gloo', this replica 'nccl'"):
        ray.get(p0.start.remote(ticket, ray.get(p0.alloc.remote(3, "nccl")), "nccl"))
    assert ray.get(d0.cancel.remote(t))
    ray.get(d0.free.remote(list(ticket["dst_slots"])))


def test_receiver_cancel_stops_writes_and_keeps_the_pair(pair):
    p0, d0 = pair
    src, dst, t = ray.get(p0.alloc.remote(12)), ray.get(d0.alloc.remote(12)), tid()
    before = ray.get(d0.read.remote(dst))
    ray.get(p0.start.remote(ray.get(d0.expect.remote(t, dst)), src))
    ray.get(p0.send_layers.remote(t, 0, 1))
    assert ray.get(d0.cancel.remote(t))
    ray.get(p0.send_layers.remote(t, 1, LAYERS))
    ray.get(p0.finish.remote(t))
    assert ray.get(d0.outcome.remote(t)) == f"TransferCancelled: transfer {t!r}: cancelled by the receiver"
    assert ray.get(p0.outcome.remote(t)).startswith(f"TransferRefused: transfer {t!r}: decode replica 'd0': ")
    # Layers sent after the cancel returned were read off the wire and dropped.
    assert torch.equal(ray.get(d0.read.remote(dst))[1:], before[1:])
    opened = ray.get(p0.stats.remote())["peers"]["d0"]["pairs_opened"]
    src2, dst2, _ = move(p0, d0, 9)
    assert torch.equal(ray.get(d0.read.remote(dst2)), ray.get(p0.read.remote(src2)))
    assert ray.get(p0.stats.remote())["peers"]["d0"]["pairs_opened"] == opened
    free(p0, d0, src + src2, dst + dst2)


def test_sender_cancel_reaches_the_receiver_and_keeps_the_pair(pair):
    p0, d0 = pair
    src, dst, t = ray.get(p0.alloc.remote(12)), ray.get(d0.alloc.remote(12)), tid()
    ray.get(p0.start.remote(ray.get(d0.expect.remote(t, dst)), src))
    ray.get(p0.send_layers.remote(t, 0, 2))
    assert ray.get(p0.cancel.remote(t))
    assert ray.get(p0.outcome.remote(t)) == f"TransferCancelled: transfer {t!r}: cancelled by the sender"
    assert ray.get(d0.outcome.remote(t)) == (
        f"TransferCancelled: transfer {t!r}: prefill replica 'p0' aborted it: cancelled by the sender"
    )
    src2, dst2, _ = move(p0, d0, 4)
    free(p0, d0, src + src2, dst + dst2)


def test_unexpected_and_stale_tickets_are_refused(pair):
    p0, d0 = pair
    src, dst = ray.get(p0.alloc.remote(5)), ray.get(d0.alloc.remote(5))
    endpoint = ray.get(d0.endpoint.remote())
    ghost = {"transfer_id": (g := tid()), "endpoint": endpoint, "dst_slots": dst, "held_tokens": 0}
    ray.get(p0.send.remote(ghost, src))
    assert ray.get(p0.outcome.remote(g)) == (
        f"TransferRefused: transfer {g!r}: decode replica 'd0': not expected (unknown, expired or cancelled)"
    )
    ticket = ray.get(d0.expect.remote(t := tid(), dst))
    stale = dict(ticket, dst_slots=list(reversed(dst)))
    ray.get(p0.send.remote(stale, src))
    reason = "the receiver's slot list differs from the ticket's (stale ticket)"
    assert ray.get(p0.outcome.remote(t)) == f"TransferRefused: transfer {t!r}: decode replica 'd0': {reason}"
    assert ray.get(d0.outcome.remote(t)) == f"TransferRefused: transfer {t!r} from 'p0': {reason}"
    free(p0, d0, src, dst)


def test_receiver_deadline(pair):
    _, d0 = pair
    dst = ray.get(d0.alloc.remote(3))
    ray.get(d0.expect.remote(t := tid(), dst, 0, 0.5))
    assert (
        ray.get(d0.outcome.remote(t)) == f"TransferTimeout: transfer {t!r}: not complete within its deadline"
    )
    ray.get(d0.free.remote(dst))


def test_sender_dies_mid_transfer(cluster, pair):
    _, d0 = pair
    px = cluster.remote("px")
    src, dst, t = ray.get(px.alloc.remote(10)), ray.get(d0.alloc.remote(10)), tid()
    ray.get(px.start.remote(ray.get(d0.expect.remote(t, dst)), src))
    ray.get(px.send_layers.remote(t, 0, 2))
    # Mid-transfer: the first payload is in, two layers are missing.
    wait_for(lambda: ray.get(d0.stats.remote())["peers"].get("px", {}).get("payloads_received") == 1)
    ray.kill(px)
    error = ray.get(d0.outcome.remote(t, 6 * TEST_CONFIG["peer_timeout"]))
    assert error.startswith(f"PeerLost: transfer {t!r}: no word from prefill replica 'px' for ")
    # The same replica id comes back (a restarted replica): a new pair, and transfers work again.
    px2 = cluster.remote("px")
    src2, dst2, _ = move(px2, d0, 10)
    assert torch.equal(ray.get(d0.read.remote(dst2)), ray.get(px2.read.remote(src2)))
    assert ray.get(d0.stats.remote())["peers"]["px"]["pairs_opened"] == 2
    ray.get([d0.free.remote(dst + dst2), px2.close.remote()])


def test_receiver_dies_mid_transfer(cluster, pair):
    p0, _ = pair
    dx = cluster.remote("dx")
    src, dst, t = ray.get(p0.alloc.remote(10)), ray.get(dx.alloc.remote(10)), tid()
    ray.get(p0.start.remote(ray.get(dx.expect.remote(t, dst)), src))
    ray.get(p0.send_layers.remote(t, 0, 1))
    assert ray.get(dx.outcome.remote(t, 0.2)) == "pending"
    ray.kill(dx)
    error = ray.get(p0.outcome.remote(t, 6 * TEST_CONFIG["peer_timeout"]))
    assert error.startswith(f"PeerLost: transfer {t!r}: "), error
    assert ray.get(p0.stats.remote())["peers"]["dx"]["transfers_failed"] == 1
    dy = cluster.remote("dy")
    src2, dst2, _ = move(p0, dy, 10)
    assert torch.equal(ray.get(dy.read.remote(dst2)), ray.get(p0.read.remote(src2)))
    ray.get([p0.free.remote(src + src2), dy.close.remote()])


def test_stalled_receiver_breaks_the_pair_and_the_next_transfer_rebuilds_it(cluster, pair):
    p0, _ = pair
    ds = cluster.remote("ds")
    src, dst, _ = move(p0, ds, 6)
    src2, dst2, t = ray.get(p0.alloc.remote(6)), ray.get(ds.alloc.remote(6)), tid()
    ticket = ray.get(ds.expect.remote(t, dst2))
    pid = ray.get(ds.pid.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        ray.get(p0.send.remote(ticket, src2, "layers"))
        error = ray.get(p0.outcome.remote(t, 6 * TEST_CONFIG["peer_timeout"]))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert error.startswith(f"PeerLost: transfer {t!r}: "), error
    late = ray.get(ds.outcome.remote(t, 6 * TEST_CONFIG["peer_timeout"]))
    assert late.startswith(f"PeerLost: transfer {t!r}: "), late
    src3, dst3, _ = move(p0, ds, 6)
    assert torch.equal(ray.get(ds.read.remote(dst3)), ray.get(p0.read.remote(src3)))
    assert ray.get(p0.stats.remote())["peers"]["ds"]["pairs_opened"] == 2
    ray.get([p0.free.remote(src + src2 + src3), ds.close.remote()])
