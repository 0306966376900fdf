"""KV transfer throughput: the transfer engine against raw torch.distributed send/recv of the
same bytes, and the time to move 1k tokens of the default model's KV, for each transport.

    python -m load_tests.bench_kv_transfer                     # ~2 minutes on 2 cores
    python -m load_tests.bench_kv_transfer --tokens 1024 --repeats 3 --json results/kv.json
    python -m load_tests.bench_kv_transfer --transports nccl   # GPU pools, one GPU per process

Two Ray actors (separate processes, one machine) hold a KV pool each, shaped like SmolLM2-135M's
(30 layers, 3 KV heads, head_dim 64, bf16). Per token count and mode:
  engine  `send(ticket, slots)` + `send_all()` ("whole") or `send_layers(l, l + 1)` per layer
          ("layers"), timed on the sender from `send` to the receiver's ACK (so gather, wire,
          scatter and one ACK round trip are all inside);
  raw     the same bytes as pre-packed contiguous tensors, as one message ("whole") or one per
          layer ("layers", all posted at once, every receive pre-posted), over a 2-rank gloo
          group built exactly as the engine builds its pair's group (make_process_group), timed
          from the first send to a 1-byte ACK back.
Each cell is run --repeats times, alternating raw and engine; best and median are reported.
With `nccl` the pools are on the GPU (a GPU per actor where the host has two, else both on its one
GPU, which NCCL may refuse: then the transport is reported skipped with the reason, as it is
where there is no GPU); it has no raw baseline.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from radixserve.workers.disaggregation import KVTicket, KVTransferConfig, create_kv_transfer_engine
from radixserve.workers.disaggregation.dist_transport import make_process_group
from radixserve.workers.mem_cache.kv_pool import KVPool

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 30, 3, 64, torch.bfloat16


class Node:
    """One replica's pool plus, for the baseline, one end of a raw gloo group."""

    def __init__(
        self, replica_id: str, transport: str, max_tokens: int, max_message_bytes: int, op_timeout: float
    ):
        device = "cuda" if transport == "nccl" else "cpu"
        self.pool = KVPool(LAYERS, KV_HEADS, HEAD_DIM, num_slots=max_tokens, dtype=DTYPE, device=device)
        for buf in self.pool.k_buffers + self.pool.v_buffers:
            buf.normal_()
        cfg = KVTransferConfig(
            op_timeout=op_timeout, transfer_timeout=300, max_message_bytes=max_message_bytes
        )
        self.engine = create_kv_transfer_engine(transport, self.pool, replica_id, "bench", "bench", cfg)
        self.handles: dict[str, Any] = {}
        self.store: dist.TCPStore | None = None
        self.pg = None

    def expect(self, tid: str, n: int) -> dict:
        slots = self.pool.alloc(n)
        assert slots is not None
        self.handles[tid] = self.engine.expect(tid, slots)
        return self.handles[tid].ticket.to_dict()

    def release(self, tid: str) -> None:
        handle = self.handles.pop(tid)
        handle.result(60)
        self.pool.free(list(handle.ticket.dst_slots))

    def engine_send(self, ticket: dict, mode: str) -> float:
        t = KVTicket.from_dict(ticket)
        src = self.pool.alloc(len(t.dst_slots))
        start = time.perf_counter()
        handle = self.engine.send(t, src)
        if mode == "whole":
            handle.send_all()
        else:
            for layer in range(LAYERS):
                handle.send_layers(layer, layer + 1)
        handle.finish().result(300)
        elapsed = time.perf_counter() - start
        self.pool.free(src)
        return elapsed

    def raw_host(self) -> int:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return self.store.port

    def raw_join(self, port: int, rank: int) -> None:
        store = self.store or dist.TCPStore("127.0.0.1", port, is_master=False)
        self.pg = make_process_group("gloo", dist.PrefixStore("raw", store), rank, 120, "127.0.0.1")

    def raw_recv(self, nbytes: int, messages: int) -> None:
        bufs = [torch.empty(nbytes // messages, dtype=torch.uint8) for _ in range(messages)]
        for work in [self.pg.recv([buf], 0, i) for i, buf in enumerate(bufs)]:
            work.wait()
        self.pg.send([torch.ones(1, dtype=torch.uint8)], 0, messages).wait()

    def raw_send(self, nbytes: int, messages: int) -> float:
        """Every message posted at once (the receiver pre-posts every receive): the wire's best."""
        bufs = [torch.ones(nbytes // messages, dtype=torch.uint8) for _ in range(messages)]
        ack = torch.empty(1, dtype=torch.uint8)
        start = time.perf_counter()
        for work in [self.pg.send([buf], 1, i) for i, buf in enumerate(bufs)]:
            work.wait()
        self.pg.recv([ack], 1, messages).wait()
        return time.perf_counter() - start

    def stats(self) -> dict:
        return self.engine.stats_snapshot()["total"]


def bytes_per_token() -> int:
    return KVPool.bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, DTYPE)


def run_engine(sender, receiver, n: int, mode: str, tid: str) -> float:
    ticket = ray.get(receiver.expect.remote(tid, n))
    elapsed = ray.get(sender.engine_send.remote(ticket, mode))
    ray.get(receiver.release.remote(tid))
    return elapsed


def run_raw(sender, receiver, n: int, mode: str) -> float:
    nbytes, messages = n * bytes_per_token(), 1 if mode == "whole" else LAYERS
    recv = receiver.raw_recv.remote(nbytes, messages)
    elapsed = ray.get(sender.raw_send.remote(nbytes, messages))
    ray.get(recv)
    return elapsed


def summary(times: list[float], nbytes: int) -> dict[str, float]:
    best, median = min(times), statistics.median(times)
    return {
        "best_s": best,
        "median_s": median,
        "best_gbps": nbytes / best / 1e9,
        "median_gbps": nbytes / median / 1e9,
    }


def bench(transport: str, tokens: list[int], repeats: int, args) -> list[dict[str, Any]]:
    with_raw, max_bytes = transport == "gloo", int(args.max_message_mib * 2**20)
    gpus = 0.0 if transport != "nccl" else 1.0 if torch.cuda.device_count() > 1 else 0.5
    node = ray.remote(num_cpus=0, num_gpus=gpus, max_concurrency=4)(Node)
    sender = node.remote("prefill-0", transport, max(tokens) + 16, max_bytes, args.op_timeout)
    receiver = node.remote("decode-0", transport, max(tokens) + 16, max_bytes, args.op_timeout)
    if with_raw:
        port = ray.get(receiver.raw_host.remote())
        ray.get([receiver.raw_join.remote(port, 1), sender.raw_join.remote(port, 0)])
    run_engine(sender, receiver, 16, "whole", "warmup")  # builds the pair
    rows = []
    for n in tokens:
        nbytes = n * bytes_per_token()
        for mode in ("whole", "layers"):
            engine_t, raw_t = [], []
            for r in range(repeats):
                if with_raw:
                    raw_t.append(run_raw(sender, receiver, n, mode))
                engine_t.append(run_engine(sender, receiver, n, mode, f"{n}-{mode}-{r}"))
            row = {
                "transport": transport,
                "tokens": n,
                "mode": mode,
                "bytes": nbytes,
                "engine": summary(engine_t, nbytes),
            }
            if with_raw:
                row["raw"] = summary(raw_t, nbytes)
                row["ratio_best"] = row["engine"]["best_gbps"] / row["raw"]["best_gbps"]
                row["ratio_median"] = row["engine"]["median_gbps"] / row["raw"]["median_gbps"]
            rows.append(row)
    ray.kill(sender)
    ray.kill(receiver)
    return rows


def unavailable(transport: str) -> str | None:
    """Why `transport` cannot be measured on this host, or None."""
    if transport == "nccl" and not torch.cuda.is_available():
        return "no CUDA GPU visible (the nccl transport moves GPU pools)"
    if transport == "nccl" and not dist.is_nccl_available():
        return "this torch has no NCCL"
    return None


def last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"KV shape: {LAYERS} layers x {KV_HEADS} KV heads x head_dim {HEAD_DIM}, bf16 = {bytes_per_token()} bytes/token"
    )
    head = f"{'transport':<9} {'tokens':>6} {'mode':<6} {'MiB':>7} {'engine ms':>10} {'GB/s':>6} {'raw ms':>8} {'GB/s':>6} {'engine/raw':>10} {'ms/1k tok':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        e = r["engine"]
        raw = r.get("raw")
        raw_cols = (
            f"{raw['median_s'] * 1e3:>8.1f} {raw['median_gbps']:>6.2f} {r['ratio_median']:>9.0%}"
            if raw
            else f"{'-':>8} {'-':>6} {'-':>10}"
        )
        per_1k = e["median_s"] * 1e3 * 1024 / r["tokens"]
        print(
            f"{r['transport']:<9} {r['tokens']:>6} {r['mode']:<6} {r['bytes'] / 2**20:>7.1f} {e['median_s'] * 1e3:>10.1f} "
            f"{e['median_gbps']:>6.2f} {raw_cols} {per_1k:>9.1f}"
        )
    print(
        "(medians; engine/raw = engine throughput over raw send/recv of the same bytes on the same kind of group)"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transports", nargs="+", default=["gloo", "ray"], choices=["gloo", "nccl", "ray"])
    ap.add_argument("--max-message-mib", type=float, default=KVTransferConfig.max_message_bytes / 2**20)
    ap.add_argument("--op-timeout", type=float, default=120, help="seconds one gloo/nccl wait may take")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    skipped = {t: why for t in args.transports if (why := unavailable(t))}
    rows: list[dict[str, Any]] = []
    if len(skipped) < len(args.transports):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            for transport in [t for t in args.transports if t not in skipped]:
                try:
                    rows += bench(transport, args.tokens, args.repeats, args)
                except Exception as exc:
                    if transport != "nccl" or torch.cuda.device_count() > 1:
                        raise
                    skipped[transport] = f"two processes on one GPU: {last_line(exc)}"
        finally:
            ray.shutdown()
    if rows:
        print_table(rows)
    for transport, why in skipped.items():
        print(f"{transport}: skipped: {why}")
    if args.json:
        with open(args.json, "w") as f:
            out = {"time": datetime.datetime.now().isoformat(), "rows": rows, "skipped": skipped}
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
