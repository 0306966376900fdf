"""KV transfer through the Ray object store (the `ray` transport), between replicas in separate
processes: exact K/V equality, suffix-only transfers, concurrency, handshake refusals,
cancellation, and peers that die mid-transfer."""

from __future__ import annotations

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
    p0, d0 = cluster.remote("p0", transport="ray"), cluster.remote("d0", transport="ray")
    yield p0, d0
    ray.get([p0.close.remote(), d0.close.remote()])


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    if "pair" in request.fixturenames:
        for peer in request.getfixturevalue("pair"):
            assert ray.get(peer.stats.remote())["open"] == {"sending": 0, "receiving": 0}


@pytest.mark.parametrize("mode", ["all", "layers", "chunks"])
@pytest.mark.parametrize(
    ("dtype", "page_size"), [("bfloat16", 1), ("bfloat16", 16), ("float32", 1), ("float32", 16)]
)
def test_received_kv_equals_sent_kv(pair, dtype, page_size, mode):
    p0, d0 = pair
    name = f"{dtype}-{page_size}"
    kwargs = dict(transport="ray", dtype=dtype, page_size=page_size)
    ray.get(
        [
            p0.ensure_engine.remote(name, f"p0-{name}", **kwargs),
            d0.ensure_engine.remote(name, f"d0-{name}", **kwargs),
        ]
    )
    sent0 = ray.get(p0.stats.remote(name))["total"]
    before = ray.get(d0.whole_pool.remote(name))
    src, dst, _ = move(p0, d0, 37, mode=mode, chunk=16, engine=name)
    assert_moved(p0, d0, src, dst, before, name)
    sent = ray.get(p0.stats.remote(name))["total"]
    assert sent["bytes_sent"] - sent0["bytes_sent"] == 37 * LAYERS * token_layer_bytes(dtype)
    fewest, most = {"all": (1, 1), "layers": (1, LAYERS), "chunks": (3, 3 * LAYERS)}[mode]
    assert fewest <= sent["payloads_sent"] - sent0["payloads_sent"] <= most
    free(p0, d0, src, dst, name)


def test_suffix_only_moves_the_pages_the_receiver_lacks(pair):
    p0, d0 = pair
    s0 = ray.get(p0.stats.remote())["peers"].get("d0", {"bytes_sent": 0, "bytes_saved": 0})
    r0 = ray.get(d0.stats.remote())["peers"].get("p0", {"bytes_received": 0, "bytes_saved": 0})
    before = ray.get(d0.whole_pool.remote())
    src, dst, _ = move(p0, d0, 64, held=48, mode="layers")
    assert_moved(p0, d0, src, dst, before)
    s1, r1 = ray.get(p0.stats.remote())["peers"]["d0"], ray.get(d0.stats.remote())["peers"]["p0"]
    tlb = token_layer_bytes()
    assert (
        s1["bytes_sent"] - s0["bytes_sent"]
        == r1["bytes_received"] - r0["bytes_received"]
        == 16 * LAYERS * tlb
    )
    assert s1["bytes_saved"] - s0["bytes_saved"] == r1["bytes_saved"] - r0["bytes_saved"] == 48 * LAYERS * tlb
    free(p0, d0, src, dst)


def test_concurrent_transfers_and_two_senders(cluster, pair):
    p0, d0 = pair
    p1 = cluster.remote("p1", transport="ray")
    before = ray.get(d0.whole_pool.remote())
    sizes = [3, 11, 26, 7]
    srcs = [ray.get(p0.alloc.remote(n)) for n in sizes]
    dsts = [ray.get(d0.alloc.remote(n)) for n in sizes]
    ids = [tid() for _ in sizes]
    tickets = [ray.get(d0.expect.remote(t, dst)) for t, dst in zip(ids, dsts)]
    other = (ray.get(p1.alloc.remote(15)), ray.get(d0.alloc.remote(15)), tid())
    refs = [
        p0.send_interleaved.remote(tickets, srcs),
        p1.send.remote(ray.get(d0.expect.remote(other[2], other[1])), other[0], "layers"),
    ]
    ray.get(refs)
    for t in ids:
        assert ray.get(d0.outcome.remote(t)) == "" and ray.get(p0.outcome.remote(t)) == ""
    assert ray.get(d0.outcome.remote(other[2])) == "" and ray.get(p1.outcome.remote(other[2])) == ""
    assert torch.equal(ray.get(d0.read.remote(other[1])), ray.get(p1.read.remote(other[0])))
    after = ray.get(d0.whole_pool.remote())
    for src, dst in zip(srcs, dsts):
        assert torch.equal(after[:, :, dst], ray.get(p0.read.remote(src)))
    rows = [s for dst in dsts for s in dst] + other[1]
    keep = torch.ones(after.shape[2], dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(after[:, :, keep], before[:, :, keep])
    free(p0, d0, [s for src in srcs for s in src], [s for dst in dsts for s in dst])
    ray.get([d0.free.remote(other[1]), p1.close.remote()])


@pytest.mark.parametrize(
    ("field", "kwargs", "theirs", "ours"), SPEC_MISMATCHES, ids=[m[0] for m in SPEC_MISMATCHES]
)
def test_handshake_mismatch_is_refused_naming_the_field_on_both_sides(pair, field, kwargs, theirs, ours):
    p0, d0 = pair
    sender = f"p-{field}"
    ray.get(p0.ensure_engine.remote(field, sender, transport="ray", **kwargs))
    src, dst, t = ray.get(p0.alloc.remote(6, field)), ray.get(d0.alloc.remote(6)), tid()
    ray.get(p0.send.remote(ray.get(d0.expect.remote(t, dst)), src, "all", 0, field))
    error = ray.get(p0.outcome.remote(t))
    assert error.startswith(f"HandshakeMismatch: transfer {t!r}: KV transfer handshake refused: ")
    assert f"{field}: prefill replica {sender!r} has {theirs!r}, decode replica 'd0' has {ours!r}" in error
    assert ray.get(p0.error_fields.remote(t)) == {field: (theirs, ours)}
    wait_for(lambda: ray.get(d0.stats.remote())["peers"].get(sender, {}).get("handshakes_refused") == 1)
    refusal = f"{field}: decode replica 'd0' has {ours!r}, prefill replica {sender!r} has {theirs!r}"
    assert refusal in ray.get(d0.refusals.remote())[-1]
    assert ray.get(d0.outcome.remote(t, 0.2)) == "pending"
    assert ray.get(d0.cancel.remote(t))
    ray.get([p0.free.remote(src, field), d0.free.remote(dst)])


def test_a_gloo_sender_is_refused_a_ray_receiver(pair):
    p0, d0 = pair
    ray.get(p0.ensure_engine.remote("gloo", "p-gloo", transport="gloo"))
    ticket = ray.get(d0.expect.remote(t := tid(), ray.get(d0.alloc.remote(3))))
    with pytest.raises(ray.exceptions.RayTaskError, match="the receiver uses 'ray', this replica 'gloo'"):
        ray.get(p0.start.remote(ticket, ray.get(p0.alloc.remote(3, "gloo")), "gloo"))
    assert ray.get(d0.cancel.remote(t))
    ray.get(d0.free.remote(list(ticket["dst_slots"])))


def test_cancel_on_either_side_keeps_the_connection(pair):
    p0, d0 = pair
    src, dst, t = ray.get(p0.alloc.remote(8)), ray.get(d0.alloc.remote(8)), tid()
    ray.get(p0.start.remote(ray.get(d0.expect.remote(t, dst)), src))
    ray.get(p0.send_layers.remote(t, 0, 1))
    assert ray.get(d0.cancel.remote(t))
    ray.get(p0.send_layers.remote(t, 1, LAYERS))
    ray.get(p0.finish.remote(t))
    assert ray.get(d0.outcome.remote(t)) == f"TransferCancelled: transfer {t!r}: cancelled by the receiver"
    assert ray.get(p0.outcome.remote(t)).startswith(f"TransferRefused: transfer {t!r}: decode replica 'd0': ")
    src2, dst2, t2 = ray.get(p0.alloc.remote(8)), ray.get(d0.alloc.remote(8)), tid()
    ray.get(p0.start.remote(ray.get(d0.expect.remote(t2, dst2)), src2))
    assert ray.get(p0.cancel.remote(t2))
    assert ray.get(d0.outcome.remote(t2)) == (
        f"TransferCancelled: transfer {t2!r}: prefill replica 'p0' aborted it: cancelled by the sender"
    )
    opened = ray.get(p0.stats.remote())["peers"]["d0"]["pairs_opened"]
    src3, dst3, _ = move(p0, d0, 5)
    assert ray.get(p0.stats.remote())["peers"]["d0"]["pairs_opened"] == opened
    free(p0, d0, src + src2 + src3, dst + dst2 + dst3)


def test_sender_dies_mid_transfer(cluster, pair):
    _, d0 = pair
    px = cluster.remote("px", transport="ray")
    src, dst, t = ray.get(px.alloc.remote(10)), ray.get(d0.alloc.remote(10)), tid()
    ray.get(px.start.remote(ray.get(d0.expect.remote(t, dst)), src))
    ray.get(px.send_layers.remote(t, 0, 2))
    wait_for(lambda: ray.get(d0.stats.remote())["peers"].get("px", {}).get("payloads_received") == 1)
    ray.kill(px)
    error = ray.get(d0.outcome.remote(t, 6 * TEST_CONFIG["peer_timeout"]))
    assert error.startswith(f"PeerLost: transfer {t!r}: no word from prefill replica 'px' for "), error
    px2 = cluster.remote("px", transport="ray")
    src2, dst2, _ = move(px2, d0, 10)
    assert torch.equal(ray.get(d0.read.remote(dst2)), ray.get(px2.read.remote(src2)))
    ray.get([d0.free.remote(dst + dst2), px2.close.remote()])


def test_receiver_dies_mid_transfer(cluster, pair):
    p0, _ = pair
    dx = cluster.remote("dx", transport="ray")
    src, dst, t = ray.get(p0.alloc.remote(10)), ray.get(dx.alloc.remote(10)), tid()
    ray.get(p0.start.remote(ray.get(dx.expect.remote(t, dst)), src))
    ray.get(p0.send_layers.remote(t, 0, 1))
    ray.kill(dx)
    error = ray.get(p0.outcome.remote(t, 6 * TEST_CONFIG["peer_timeout"]))
    assert error.startswith(f"PeerLost: transfer {t!r}: "), error
    dy = cluster.remote("dy", transport="ray")
    src2, dst2, _ = move(p0, dy, 10)
    assert torch.equal(ray.get(dy.read.remote(dst2)), ray.get(p0.read.remote(src2)))
    ray.get([p0.free.remote(src + src2), dy.close.remote()])
