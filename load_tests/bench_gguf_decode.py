"""Decode at batch 1 on a GGUF file: this engine computing from the file's blocks (`--quantization
gguf`, with float and with int8 activations), the same engine on the dequantized weights, and
llama.cpp's llama-server on the same file, side by side in one run (the systems take turns round
after round; medians reported).

The rate is each engine's own decode rate: tokens after the first over the time from the first to
the last (this engine: streamed chunks of the offline Engine, greedy, ignore_eos; llama-server: the
`timings.predicted_per_second` it reports for a /completion request with cache_prompt off).

    python -m load_tests.bench_gguf_decode [--model FILE.gguf] [--tokens 128] [--rounds 3]
    (llama-server on the PATH, or --llama-server PATH; built by llama.cpp's CMake target)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. The story "
    "should have a beginning, a middle and an end, and it should be told in the first person."
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, binary: str, model: Path, threads: int):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                binary,
                "-m",
                str(model),
                "-t",
                str(threads),
                "-c",
                "2048",
                "-np",
                "1",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def decode_rate(self, tokens: int) -> float:
        body = {
            "prompt": PROMPT,
            "n_predict": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        return float(out["timings"]["predicted_per_second"])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class OurEngine:
    def __init__(self, model: str | None, quantization: str, activations: str = "float"):
        from radixserve.workers import Engine

        self.engine = Engine(
            model, quantization=quantization, quantized_activations=activations, max_total_tokens=4096
        )

    def decode_rate(self, tokens: int) -> float:
        async def run() -> float:
            params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
            stamps: list[tuple[float, int]] = []
            stream = await self.engine.async_generate(PROMPT, params, stream=True)
            async for out in stream:
                stamps.append((time.perf_counter(), len(out["output_ids"])))
            (t0, n0), (t1, n1) = stamps[0], stamps[-1]
            return (n1 - n0) / (t1 - t0)

        return asyncio.run(run())

    def close(self) -> None:
        self.engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's -t")
    p.add_argument("--llama-server", default=shutil.which("llama-server"))
    args = p.parse_args()
    from radixserve.workers.models.loader import default_gguf_path

    gguf = Path(args.model) if args.model else default_gguf_path()
    systems: dict[str, Any] = {
        "radixserve gguf": OurEngine(args.model, "gguf"),
        "radixserve gguf int8 act": OurEngine(args.model, "gguf", "int8"),
        "radixserve dequantized": OurEngine(args.model, "none"),
    }
    if args.llama_server:
        systems["llama-server"] = LlamaServer(args.llama_server, gguf, args.threads)
    else:
        print("llama-server not found (--llama-server PATH): comparing this engine's two modes only")
    try:
        for s in systems.values():
            s.decode_rate(8)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in systems}
        for _ in range(args.rounds):
            for name, s in systems.items():
                rates[name].append(s.decode_rate(args.tokens))
    finally:
        for s in systems.values():
            s.close()
    ref = statistics.median(rates["llama-server"]) if "llama-server" in rates else None
    print(f"{gguf.name}: decode at batch 1, {args.tokens} tokens, median of {args.rounds} rounds")
    for name, r in rates.items():
        med = statistics.median(r)
        ratio = f"  {med / ref:5.2f}x llama-server" if ref else ""
        print(f"  {name:24s} {med:8.1f} tok/s{ratio}   (rounds: {', '.join(f'{x:.1f}' for x in r)})")


if __name__ == "__main__":
    main()
