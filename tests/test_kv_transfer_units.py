"""KV transfer pieces in one process: the handshake spec and its refusals, the model fingerprint,
the message codec, gather/scatter and payload splitting, the per-layer send order, transport
choice, config checks, and an engine's close()."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from radixserve.workers.disaggregation import (
    HandshakeMismatch,
    KVEndpoint,
    KVSpec,
    KVTicket,
    KVTransferConfig,
    PeerLost,
    TransferCancelled,
    TransferTimeout,
    create_kv_transfer_engine,
    model_fingerprint,
    resolve_transport,
)
from radixserve.workers.disaggregation.messages import (
    Frame,
    FrameKind,
    Hello,
    HelloReply,
    decode,
    encode,
    slots_digest,
)
from radixserve.workers.disaggregation.packing import Piece, PoolView
from radixserve.workers.disaggregation.send_pair import NOTHING, coalesce
from radixserve.workers.disaggregation.spec import check_peer
from radixserve.workers.disaggregation.transfer import SendHandle
from radixserve.workers.mem_cache.kv_pool import KVPool

FAST = KVTransferConfig(op_timeout=3, connect_timeout=10, heartbeat_interval=0.2, peer_timeout=2)


def make_pool(dtype=torch.bfloat16, page_size=1, layers=3, slots=64, seed=0):
    pool = KVPool(layers, 2, 4, num_slots=slots, dtype=dtype, page_size=page_size)
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.k_buffers + pool.v_buffers:
        buf[page_size:].copy_(torch.randn(buf[page_size:].shape, generator=gen))
    return pool


def test_spec_describes_the_pool_and_validates():
    spec = KVSpec.for_pool(make_pool(page_size=4), "smollm2", "abc", "gloo")
    assert spec == KVSpec("smollm2", "abc", "bfloat16", 4, 3, 2, 4, "gloo", 2, 0, 2)
    assert KVSpec.from_dict(spec.to_dict()) == spec
    # A tensor-parallel rank's pool: heads [1, 3) of the model's 4.
    rank = KVSpec.for_pool(make_pool(), "smollm2", "abc", "gloo", (1, 3, 4))
    assert (rank.num_kv_heads, rank.kv_heads) == (4, (1, 3))
    check_peer(spec.__class__(**{**rank.to_dict(), "kv_head_begin": 0, "kv_head_end": 2}), rank, "a", "b")
    with pytest.raises(ValueError, match=r"KV heads \[1, 2\) for a pool of 2 heads"):
        KVSpec.for_pool(make_pool(), "smollm2", "abc", "gloo", (1, 2, 4))
    with pytest.raises(ValueError, match=r"KV heads \[3, 5\) are not within the model's 4"):
        dataclasses.replace(rank, kv_head_begin=3, kv_head_end=5)
    with pytest.raises(ValueError, match="unknown KV transport 'tcp'"):
        dataclasses.replace(spec, transport="tcp")
    with pytest.raises(ValueError, match="KVSpec.page_size must be a positive integer, got 0"):
        dataclasses.replace(spec, page_size=0)
    with pytest.raises(ValueError, match="unknown KVSpec field"):
        KVSpec.from_dict({**spec.to_dict(), "extra": 1})


def test_check_peer_names_every_differing_field_with_both_values():
    a = KVSpec("m", "f", "bfloat16", 1, 30, 3, 64, "gloo")
    b = dataclasses.replace(a, dtype="float32", page_size=16)
    check_peer(a, a, "x", "y")
    with pytest.raises(HandshakeMismatch) as info:
        check_peer(a, b, "prefill replica 'p'", "decode replica 'd'")
    assert str(info.value) == (
        "KV transfer handshake refused: dtype: prefill replica 'p' has 'bfloat16', decode replica 'd' has "
        "'float32'; page_size: prefill replica 'p' has 1, decode replica 'd' has 16"
    )
    assert info.value.fields == {"dtype": ("bfloat16", "float32"), "page_size": (1, 16)}


def test_model_fingerprint_samples_weights_and_hashes_the_config():
    w = torch.arange(1000, dtype=torch.float32)
    base = model_fingerprint({"layers": 2}, [("w", w)])
    assert base == model_fingerprint({"layers": 2}, [("w", w.clone())]) and len(base) == 32
    assert model_fingerprint({"layers": 3}, [("w", w)]) != base
    changed = w.clone()
    changed[0] += 1  # element 0 is always sampled
    assert model_fingerprint({"layers": 2}, [("w", changed)]) != base
    assert model_fingerprint({"layers": 2}, [("w", w.to(torch.bfloat16))]) != base
    assert model_fingerprint({"layers": 2}, [("w", w.view(10, 100))]) != base
    assert model_fingerprint({"layers": 2}, [("v", w)]) != base
    # A sample, not a hash of every byte: element 1 sits between samples (stride 1000 // 64 = 15).
    unsampled = w.clone()
    unsampled[1] += 1
    assert model_fingerprint({"layers": 2}, [("w", unsampled)]) == base


def test_codec_round_trips_every_message_and_refuses_unknown_types():
    spec = KVSpec("m", "f", "float32", 16, 2, 2, 8, "ray")
    frame = Frame(FrameKind.DATA, "t1", seq=7, layer_begin=1, layer_end=2, token_begin=16, token_end=32)
    for msg in (
        frame,
        Frame(FrameKind.ACK, "t1", error="refused"),
        Hello("p0", "n" * 32, spec),
        HelloReply("d0", spec, "no", {"dtype": ["a", "b"]}),
    ):
        assert decode(encode(msg)) == msg
    # Defaults stay off the wire.
    assert frame.to_dict() == {
        "kind": "data",
        "transfer_id": "t1",
        "seq": 7,
        "layer_begin": 1,
        "layer_end": 2,
        "token_begin": 16,
        "token_end": 32,
    }
    ticket = KVTicket("t1", KVEndpoint("gloo", "d0", "10.0.0.2:5555"), (5, 6, 7), held_tokens=16)
    assert KVTicket.from_dict(ticket.to_dict()) == ticket
    with pytest.raises(ValueError, match="unknown KV transfer message type 'pickle'"):
        decode(b'{"type": "pickle", "body": {}}')
    with pytest.raises(ValueError):
        decode(encode(frame).replace(b'"data"', b'"bogus"'))
    assert slots_digest([1, 2, 3]) != slots_digest([3, 2, 1])


@pytest.mark.parametrize("page_size", [1, 16])
def test_gather_scatter_moves_exactly_the_listed_slots(page_size):
    src_pool, dst_pool = make_pool(page_size=page_size, seed=1), make_pool(page_size=page_size, seed=2)
    before = [b.clone() for b in dst_pool.k_buffers + dst_pool.v_buffers]
    src_view, dst_view = PoolView(src_pool), PoolView(dst_pool)
    src = src_view.slot_index(src_pool.alloc(20))
    dst = dst_view.slot_index(dst_pool.alloc(20))
    piece = Piece(0, 3, 5, 20)
    out = torch.empty(src_view.payload_shape(piece), dtype=torch.bfloat16)
    dst_view.scatter(dst, piece, src_view.gather(src, piece, out))
    for layer in range(3):
        for bufs_s, bufs_d, old in (
            (src_pool.k_buffers, dst_pool.k_buffers, before[:3]),
            (src_pool.v_buffers, dst_pool.v_buffers, before[3:]),
        ):
            assert torch.equal(bufs_d[layer][dst[5:]], bufs_s[layer][src[5:]])
            untouched = torch.ones(bufs_d[layer].shape[0], dtype=torch.bool)
            untouched[dst[5:]] = False
            assert torch.equal(bufs_d[layer][untouched], old[layer][untouched])
    assert src_view.payload_bytes(piece) == 3 * 15 * 2 * 2 * 4 * 2
    with pytest.raises(ValueError, match="reserved page"):
        src_view.slot_index([0 if page_size == 1 else page_size - 1])
    with pytest.raises(ValueError, match="past the end"):
        src_view.slot_index([64 + page_size])


def test_an_fp8_pool_moves_its_bytes_as_they_are():
    fp8 = torch.float8_e4m3fn
    src_pool, dst_pool = make_pool(dtype=fp8, seed=1), make_pool(dtype=fp8, seed=2)
    src_view, dst_view = PoolView(src_pool), PoolView(dst_pool)
    src, dst = src_view.slot_index(src_pool.alloc(9)), dst_view.slot_index(dst_pool.alloc(9))
    piece = Piece(0, 3, 0, 9)
    out = torch.empty(src_view.payload_shape(piece), dtype=fp8)
    dst_view.scatter(dst, piece, src_view.gather(src, piece, out))
    assert src_view.payload_bytes(piece) == 3 * 9 * 2 * 2 * 4
    for got, sent in zip(dst_pool.k_buffers + dst_pool.v_buffers, src_pool.k_buffers + src_pool.v_buffers):
        assert torch.equal(got[dst].view(torch.uint8), sent[src].view(torch.uint8))


def test_split_cuts_whole_layers_then_token_ranges():
    view = PoolView(make_pool(layers=4))  # 32 bytes per token per layer
    whole = Piece(0, 4, 0, 10)  # 320 bytes per layer
    assert list(view.split(whole, 1 << 20)) == [whole]
    assert list(view.split(whole, 700)) == [Piece(0, 2, 0, 10), Piece(2, 4, 0, 10)]
    assert list(view.split(Piece(1, 3, 0, 10), 200)) == [
        Piece(1, 2, 0, 6),
        Piece(1, 2, 6, 10),
        Piece(2, 3, 0, 6),
        Piece(2, 3, 6, 10),
    ]
    assert list(view.split(Piece(0, 1, 0, 3), 1)) == [Piece(0, 1, 0, 1), Piece(0, 1, 1, 2), Piece(0, 1, 2, 3)]


ALL_HEADS = (0, 2)  # make_pool's: a handle's pieces name the heads they move


def make_handle(num_tokens=10, layers=3, max_bytes=1 << 20):
    pool = make_pool(layers=layers)
    view = PoolView(pool)
    ops = []
    ticket = KVTicket("t", KVEndpoint("gloo", "d0", "h:1"), tuple(range(1, num_tokens + 1)))
    src = view.slot_index(pool.alloc(num_tokens))
    handle = SendHandle(ticket, src, view, ops.append, lambda h, e: h.settle(e), max_bytes, deadline=1e18)
    return handle, ops


def test_send_order_per_layer_and_send_all_sends_the_rest():
    handle, ops = make_handle()
    handle.send_layers(0, 3, 0, 4)  # a first prefill chunk, every layer
    handle.send_layers(0, 1, 4, 10)  # the second chunk: layer 0 only so far
    with pytest.raises(ValueError, match="layer 1: next token is 4, got 6"):
        handle.send_layers(1, 2, 6, 10)
    with pytest.raises(ValueError, match="finish before every layer was sent"):
        handle.finish()
    handle.send_all()
    handle.finish()
    pieces = [(o.frame.kind, o.piece) for o in ops]
    assert pieces == [
        (FrameKind.DATA, Piece(0, 3, 0, 4, *ALL_HEADS)),
        (FrameKind.DATA, Piece(0, 1, 4, 10, *ALL_HEADS)),
        (FrameKind.DATA, Piece(1, 3, 4, 10, *ALL_HEADS)),
        (FrameKind.END, None),
    ]
    with pytest.raises(ValueError, match="send_layers after finish"):
        handle.send_layers(0, 1, 0, 1)
    with pytest.raises(ValueError, match=r"layers \[2, 4\) outside \[0, 3\)"):
        make_handle()[0].send_layers(2, 4)


def test_coalesce_merges_the_next_layers_of_the_same_tokens_up_to_the_size_limit():
    handle, ops = make_handle(num_tokens=10, layers=3)
    other, other_ops = make_handle(num_tokens=10, layers=3)
    for layer in range(3):
        handle.send_layers(layer, layer + 1, 0, 4)
    handle.send_layers(0, 1, 4, 10)  # the next chunk: other tokens, never merged with the first
    other.send_layers(0, 3)
    view = handle.view
    layer_bytes = view.payload_bytes(Piece(0, 1, 0, 4, *ALL_HEADS))

    def take_from(queued):
        it = iter(queued)
        return lambda: next(it, NOTHING)

    merged, rest = coalesce(ops[0], take_from(ops[1:]), view, 1 << 20)
    assert merged.piece == Piece(0, 3, 0, 4, *ALL_HEADS) and rest is ops[3]
    assert (merged.frame.kind, merged.frame.layer_begin, merged.frame.layer_end) == (FrameKind.DATA, 0, 3)
    assert (merged.frame.token_begin, merged.frame.token_end) == (0, 4)
    merged, rest = coalesce(ops[0], take_from(ops[1:]), view, 2 * layer_bytes)
    assert merged.piece == Piece(0, 2, 0, 4, *ALL_HEADS) and rest is ops[2]
    merged, rest = coalesce(ops[2], take_from([other_ops[0]]), view, 1 << 20)
    assert merged is ops[2] and rest is other_ops[0]
    merged, rest = coalesce(ops[3], take_from([]), view, 1 << 20)
    assert merged is ops[3] and rest is NOTHING


def test_cancel_settles_once_and_later_sends_are_no_ops():
    handle, ops = make_handle()
    assert handle.cancel()
    assert not handle.cancel()
    handle.send_layers(0, 3)
    assert ops == [] and handle.done()
    with pytest.raises(Exception, match="cancelled by the sender"):
        handle.result(0)


def test_transport_choice_and_config_checks():
    pool = make_pool()
    assert resolve_transport("auto", pool) == "gloo"
    assert resolve_transport("ray", pool) == "ray"
    with pytest.raises(ValueError, match="--kv-transfer must be one of auto, gloo, nccl, ray, got 'rdma'"):
        resolve_transport("rdma", pool)
    # A GPU pool (only its device is read): nccl by default, ray too, never gloo (host memory only).
    gpu_pool = make_pool()
    gpu_pool.device = torch.device("cuda", 0)
    assert resolve_transport("auto", gpu_pool) == "nccl"
    assert resolve_transport("ray", gpu_pool) == "ray"
    with pytest.raises(
        ValueError, match="--kv-transfer gloo moves CPU tensors; a GPU KV pool moves over nccl or ray"
    ):
        resolve_transport("gloo", gpu_pool)
    with pytest.raises(ValueError, match="peer_timeout must exceed two heartbeat intervals"):
        KVTransferConfig(heartbeat_interval=1, peer_timeout=2)
    with pytest.raises(ValueError, match="op_timeout must be > 0"):
        KVTransferConfig(op_timeout=0)


def test_engine_refuses_a_spec_that_does_not_describe_its_pool():
    from radixserve.workers.disaggregation.dist_transport import TorchDistTransferEngine

    pool = make_pool()
    spec = dataclasses.replace(KVSpec.for_pool(pool, "m", "f", "gloo"), head_dim=8)
    with pytest.raises(ValueError, match="KVSpec.head_dim is 8 but the pool's is 4"):
        TorchDistTransferEngine(pool, spec, "d0", FAST)


def kv_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kv-")}


def test_in_process_loopback_and_close_fails_open_transfers():
    before = kv_threads()
    send_pool, recv_pool = make_pool(seed=3), make_pool(seed=4)
    sender = create_kv_transfer_engine("auto", send_pool, "p0", "m", "f", FAST)
    receiver = create_kv_transfer_engine("gloo", recv_pool, "d0", "m", "f", FAST)
    try:
        src, dst = send_pool.alloc(9), recv_pool.alloc(9)
        recv = receiver.expect("t1", dst)
        assert recv.ticket.endpoint.transport == "gloo" and recv.ticket.dst_slots == tuple(dst)
        with pytest.raises(ValueError, match="transfer 't1' is already expected"):
            receiver.expect("t1", dst)
        send = sender.send(recv.ticket, src)
        with pytest.raises(ValueError, match="transfer 't1' is already being sent"):
            sender.send(recv.ticket, src)
        send.send_all()
        send.finish().result(30)
        recv.result(30)
        assert recv.progress() == [9, 9, 9]
        for layer in range(3):
            assert torch.equal(recv_pool.k_buffers[layer][dst], send_pool.k_buffers[layer][src])
            assert torch.equal(recv_pool.v_buffers[layer][dst], send_pool.v_buffers[layer][src])
        # Nothing to move (the receiver holds every token): BEGIN and END only.
        empty = receiver.expect("t0", [], held_tokens=9)
        sender.send(empty.ticket, []).finish().result(30)
        empty.result(30)
        pending = receiver.expect("t2", recv_pool.alloc(2))
        half = sender.send(pending.ticket, send_pool.alloc(2))
        half.send_layers(0, 1)
        receiver.close()
        with pytest.raises(Exception, match="transfer 't2': the KV transfer engine closed"):
            pending.result(0)
        # The sender hears of it at once (the receiver's goodbye), not after peer_timeout.
        with pytest.raises(
            PeerLost,
            match="transfer 't2': .*decode replica 'd0' dropped the pair: the KV transfer engine closed",
        ):
            half.result(FAST.peer_timeout / 2)
        saved = 9 * 3 * 2 * 2 * 4 * 2
        assert sender.stats.peer("d0").bytes_saved == receiver.stats.peer("p0").bytes_saved == saved
    finally:
        sender.close()
        receiver.close()
    assert receiver.open_transfers() == {"sending": 0, "receiving": 0}
    with pytest.raises(Exception, match="the KV transfer engine is closed"):
        receiver.endpoint()
    assert kv_threads() <= before


def test_sender_deadline_aborts_the_transfer_on_both_sides():
    send_pool, recv_pool = make_pool(seed=5), make_pool(seed=6)
    sender = create_kv_transfer_engine("gloo", send_pool, "p0", "m", "f", FAST)
    receiver = create_kv_transfer_engine("gloo", recv_pool, "d0", "m", "f", FAST)
    try:
        recv = receiver.expect("late", recv_pool.alloc(4))
        send = sender.send(recv.ticket, send_pool.alloc(4), timeout=0.3)
        send.send_layers(0, 1)  # and never the rest
        with pytest.raises(TransferTimeout, match=r"transfer 'late' to 'd0': not acknowledged after \d"):
            send.result(10)
        with pytest.raises(
            TransferCancelled,
            match=r"transfer 'late': prefill replica 'p0' aborted it: transfer 'late' to 'd0': not acknowledged",
        ):
            recv.result(10)
        assert sender.stats.peer("d0").transfers_failed == receiver.stats.peer("p0").transfers_failed == 1
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(
    ("heads", "dim", "dtype", "row_dtype"),
    [
        (2, 4, torch.bfloat16, torch.int64),
        (1, 3, torch.bfloat16, torch.int16),
        (1, 3, torch.float32, torch.int32),
    ],
)
def test_rows_move_as_the_widest_integer_that_divides_them(heads, dim, dtype, row_dtype):
    pools = [KVPool(2, heads, dim, num_slots=16, dtype=dtype) for _ in range(2)]
    for i, pool in enumerate(pools):
        for buf in pool.k_buffers + pool.v_buffers:
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(i)))
    src_view, dst_view = PoolView(pools[0]), PoolView(pools[1])
    assert src_view.row_dtype == row_dtype
    src, dst = src_view.slot_index([3, 1, 7]), dst_view.slot_index([9, 10, 2])
    piece = Piece(0, 2, 0, 3)
    payload = src_view.gather(src, piece, torch.empty(src_view.payload_shape(piece), dtype=dtype))
    dst_view.scatter(dst, piece, payload)
    for layer in range(2):
        assert torch.equal(pools[1].k_buffers[layer][dst], pools[0].k_buffers[layer][src])
        assert torch.equal(pools[1].v_buffers[layer][dst], pools[0].v_buffers[layer][src])


@pytest.mark.parametrize(("dim", "dtype"), [(4, torch.bfloat16), (3, torch.bfloat16), (3, torch.float32)])
def test_a_head_range_moves_between_pools_of_other_head_shares(dim, dtype):
    """A rank holding the model's KV heads [0, 3) sends head 2 to a rank holding only [2, 3), and
    that rank sends it back into heads [2, 3) of a third: only that head's rows are read or
    written (an offset row, moved as the widest integer dividing its offset and size too)."""
    gen = torch.Generator().manual_seed(0)
    full, part, back = (KVPool(2, n, dim, num_slots=16, dtype=dtype) for n in (3, 1, 3))
    for pool in (full, part, back):
        for buf in pool.k_buffers + pool.v_buffers:
            buf.copy_(torch.randn(buf.shape, generator=gen))
    full_view, part_view, back_view = PoolView(full), PoolView(part, (2, 3)), PoolView(back)
    before = [b.clone() for b in back.k_buffers + back.v_buffers]
    piece = Piece(0, 2, 0, 3, 2, 3)
    assert full_view.payload_shape(piece) == part_view.payload_shape(piece) == (2, 2, 3, 1, dim)
    src, mid, dst = (
        full_view.slot_index([3, 1, 7]),
        part_view.slot_index([9, 10, 2]),
        back_view.slot_index([4, 5, 6]),
    )
    payload = full_view.gather(src, piece, torch.empty(full_view.payload_shape(piece), dtype=dtype))
    part_view.scatter(mid, piece, payload)
    payload = part_view.gather(mid, piece, torch.empty(part_view.payload_shape(piece), dtype=dtype))
    back_view.scatter(dst, piece, payload)
    for layer in range(2):
        for bufs in ("k_buffers", "v_buffers"):
            src_buf, mid_buf, dst_buf = (getattr(p, bufs)[layer] for p in (full, part, back))
            assert torch.equal(mid_buf[mid, 0], src_buf[src, 2])
            assert torch.equal(dst_buf[dst, 2], src_buf[src, 2])
    after = back.k_buffers + back.v_buffers
    for b, a in zip(before, after):
        a[dst, 2] = b[dst, 2]
        assert torch.equal(a, b)  # nothing but head 2 of the three slots changed
    with pytest.raises(ValueError, match=r"KV heads \[1, 3\) are not all in this pool's \[2, 3\)"):
        part_view.gather(mid, Piece(0, 1, 0, 1, 1, 3), payload)
