"""The address a KV transfer engine gives its peers is its Ray node's, not loopback: on a cluster
a decode replica's store and both sides' gloo devices must be where the other node can reach
them (deploy/e2e.sh moves the KV between two hosts' addresses). No Ray cluster is started: the
node address is what `ray.util.get_node_ip_address` answers."""

from __future__ import annotations

import ray
import torch

from radixserve.workers.disaggregation import KVTransferConfig, create_kv_transfer_engine
from radixserve.workers.disaggregation.dist_link import default_host
from radixserve.workers.mem_cache.kv_pool import KVPool

FAST = KVTransferConfig(op_timeout=3, connect_timeout=10, heartbeat_interval=0.2, peer_timeout=2)
# A local address other than 127.0.0.1 stands for the node's: the loopback net is all local.
NODE_IP = "127.0.0.2"


def make_pool(seed: int) -> KVPool:
    pool = KVPool(2, 2, 4, num_slots=32, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.k_buffers + pool.v_buffers:
        buf[1:].copy_(torch.randn(buf[1:].shape, generator=gen))
    return pool


def on_ray_node(monkeypatch, ip: str) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: ip)


def test_without_ray_the_address_is_loopback(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert default_host() == "127.0.0.1"


def test_engines_advertise_and_move_kv_at_the_ray_node_address(monkeypatch):
    on_ray_node(monkeypatch, NODE_IP)
    assert default_host() == NODE_IP
    send_pool, recv_pool = make_pool(1), make_pool(2)
    sender = create_kv_transfer_engine("gloo", send_pool, "p0", "m", "f", FAST)
    receiver = create_kv_transfer_engine("gloo", recv_pool, "d0", "m", "f", FAST)
    try:
        assert (sender.host, receiver.host) == (NODE_IP, NODE_IP)
        src, dst = send_pool.alloc(5), recv_pool.alloc(5)
        recv = receiver.expect("t1", dst)
        host, _, port = recv.ticket.endpoint.address.rpartition(":")
        assert host == NODE_IP and int(port) > 0
        send = sender.send(recv.ticket, src)
        send.send_all()
        send.finish().result(30)
        recv.result(30)
        for layer in range(2):
            assert torch.equal(recv_pool.k_buffers[layer][dst], send_pool.k_buffers[layer][src])
            assert torch.equal(recv_pool.v_buffers[layer][dst], send_pool.v_buffers[layer][src])
        moved = 5 * 2 * 2 * (2 * 4 * 2)  # tokens x layers x (K, V) x (heads x dim x bf16 bytes)
        assert sender.stats.peer("d0").bytes_sent == receiver.stats.peer("p0").bytes_received == moved
    finally:
        sender.close()
        receiver.close()
