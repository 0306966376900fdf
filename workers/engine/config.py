"""Engine configuration: frozen, validated once; derived values are computed, never written back."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from radixserve.workers.distributed.device import DEVICES
from radixserve.workers.distributed.parallel import ParallelConfig
from radixserve.workers.mem_cache.radix_cache import EVICTION_POLICIES
from radixserve.workers.models.attention import ATTENTION_BACKENDS
from radixserve.workers.models.quant_weight import ACTIVATIONS, QUANTIZATIONS
from radixserve.workers.protocol import KV_TRANSFER_CHOICES, ROLES, Role

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight")
# enable_overlap=None leaves overlap off on CPU, where it measured slower (2 cores, SmolLM2-135M, one
# engine per process): batch-16 decode 450 tok/s off, 285-300 on; bench_offline --overlap both
# --scale 0.5: on/off 0.66x (decode b8), 0.56x (b32), 0.55x (prefill-heavy mix). The forward's
# OpenMP team already uses every core, so a busy engine thread beside it only preempts a worker
# mid-op; the host work it could hide is ~4 ms of a ~27 ms step. On CUDA the forward is queued
# asynchronously and the host work of the next step is what keeps the GPU fed: overlap is on.
DEFAULT_OVERLAP = {"cpu": False, "cuda": True}


KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None = the embedded default model
    served_model_name: str | None = None
    dtype: str = "auto"  # auto = bf16 where the CPU/GPU supports it, else fp32
    # Quantized weights (workers/models/quant_weight.py): auto (gguf for a GGUF model on the CPU
    # with dtype auto, else none) | none | int8 (per output channel, quantized at load) | fp8 (e4m3
    # per output channel, quantized at load; torch._scaled_mm on GPUs with fp8 tensor cores) | gguf
    # (a GGUF model computed from its own blocks). AWQ / GPTQ / compressed-tensors / fp8 checkpoints
    # run from their packed values under auto and none.
    quantization: str = "auto"
    # How quantized projections multiply decode rows: float (exact up to summation order) | int8
    # (rows rounded to int8 per block of 32, integer products: faster, as llama.cpp computes).
    quantized_activations: str = "float"
    device: str = "auto"  # one of DEVICES: auto = cuda where torch sees a GPU, else cpu
    context_length: int | None = None  # default: the model's
    mem_fraction_static: float | None = None  # share of memory for weights + KV pool
    max_total_tokens: int | None = None  # KV pool size in tokens (wins over mem_fraction_static)
    page_size: int = 1
    max_running_requests: int = 64
    # Queued sequences (not requests: n = 8 counts 8), from submission until admitted to the
    # running batch; beyond it submissions get QueueFull (503). None = unbounded. The name is kept
    # for compatibility with SGLang's flag.
    max_queued_requests: int | None = None
    max_prefill_tokens: int = 8192  # token budget of one prefill batch
    chunked_prefill_size: int = 2048  # -1 or 0 disables chunking
    # A prefill step also carries every running decode (one token each, out of the prefill's token
    # budget): decodes never wait behind a prefill, and one forward reads the weights for both. Off
    # by default: a forward that fails fails every sequence of its step, and a new prompt's first
    # chunk then shares its step with the running decodes instead of running alone. And the ITL
    # bound costs throughput on CPU, where a prefill token costs as much as a few decode steps'
    # share of the weights: closed loop of 8, offline, the shared-prompt workload took 6.6-6.9 s
    # mixed at the ratio below against 5.1 unmixed (171 steps against 139: prompts advanced ~70
    # tokens a step, their TTFT grew, and fewer sequences decoded at a time, 6.6 against 8), the
    # unrelated-prompt workload 9.8-10.6 against 8.1-8.2; mixed with the whole chunk took what
    # unmixed took (5.2, 8.2 s) and bounds nothing.
    enable_mixed_chunk: bool = False
    # A mixed step carries as many prefill tokens as keep its time near this many decode steps'
    # (learned from the steps run, engine/step_cost.py), within the chunk size; <= 1: the chunk.
    # This bounds the decodes' inter-token latency, at the price of the waiting prompts' TTFT
    # (load_tests/bench_mixed.py measures both).
    mixed_step_ratio: float = 2.5
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"  # lru | lfu (radix_cache.py)
    # Tiered prefix cache (mem_cache/radix_cache.py): KV evicted from the device pool moves to
    # host memory, from there to files on local disk, and is copied back when a prompt matches
    # it. Sizes in GiB; 0 = no such tier. The disk tier spills from the host tier.
    hicache_host_size: float = 0.0
    hicache_disk_dir: str | None = None
    hicache_disk_size: float = 0.0
    enable_overlap: bool | None = None  # None = DEFAULT_OVERLAP of the device
    # Multi-LoRA (workers/lora/): adapters served at start ("name=path", or a path named after its
    # directory); enable_lora also without any, for adapters loaded at run time. A batch mixes at
    # most max_loras_per_batch adapters; max_lora_rank (None: the largest rank of lora_paths, at
    # least 16) sizes the batch buffers; max_loaded_loras (None: twice max_loras_per_batch, or
    # all of lora_paths if more) adapters stay in memory, the least recently used dropped beyond.
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    max_loaded_loras: int | None = None
    attention_backend: str = "auto"  # models/attention.py: auto | cpu | torch | triton | torch_ref
    # The KV cache's element type: auto (the model's dtype) | int8 (each token's head rounded to
    # int8 with a float32 scale of its own: 0.53x bf16's bytes at head size 64, kernels/csrc/
    # kv_int8.h; bf16 models on the cpu attention backend of AVX512-BF16 CPUs) | fp8_e4m3 (e4m3
    # with a scale per layer, the checkpoint's k_scale / v_scale or 1.0: half of bf16's bytes; the
    # triton attention backend, the default on a GPU).
    kv_cache_dtype: str = "auto"
    # CUDA graphs of the decode forward, one per batch-size bucket (CUDA only; tp_size 1).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 64
    random_seed: int = 0
    # Batch-invariant kernels (fixed-order GEMM at every row count, attention over key blocks from
    # position 0 in prefill and decode alike): a request's tokens, seeded sampling included, are
    # bitwise the same whatever else runs. CPU only, bf16 packed GEMM, tp_size 1 (validated here
    # and at load); load_tests/bench_deterministic.py measures its cost.
    deterministic: bool = False
    num_threads: int | None = None  # torch threads of each rank; None: all cores (a rank: its share)
    # Tensor parallelism: tp_size ranks run every forward, each with its shard of the model and a
    # KV pool of its own heads; rank 0 (this engine) schedules. ep_size spreads a MoE model's
    # experts over them (it divides tp_size). The model's layout is checked at start-up.
    tp_size: int = 1
    ep_size: int = 1
    grammar_compile_timeout_s: float = 10.0
    enable_jump_forward: bool = True  # append grammar-forced tokens without a decode step each
    # A piece of the engine thread's work (one request's token or text work, a step's forward)
    # still running after this long is logged with the request(s) it serves (engine/watchdog.py).
    step_watchdog_s: float = 10.0
    stream_interval: int = 1  # stream every N tokens
    # A streaming sequence's next chunk leaves at least this long after its previous one (its
    # first and final chunks at once); the tokens of the steps in between go together. Each chunk
    # costs every hop on its way to the client (replica, ingress, HTTP proxy) the same CPU whatever
    # it carries, on the cores the forward runs on. 0 = every chunk as soon as it is due.
    stream_interval_ms: float = 50.0
    # PD disaggregation. The role is set per deployment by the application builder, never by
    # the user; a prefill or decode engine moves KV over `kv_transfer` (auto: nccl on CUDA pools,
    # gloo on CPU; or ray, the object store), and each side frees a transfer's slots when it has
    # not completed within `kv_transfer_timeout_s`.
    role: Role = Role.UNIFIED
    kv_transfer: str = "auto"
    kv_transfer_timeout_s: float = 30.0
    # Prefill role: send each layer of a prompt's last chunk as the forward writes it (False:
    # the whole prompt after the forward; load_tests/bench_handoff.py compares the two).
    kv_transfer_layerwise: bool = True
    # Decode role: the tp_size of the prefill replicas its KV comes from (0: its own). Set by the
    # application builder from --prefill-tp; each rank expects each of its heads from the prefill
    # rank that the plan of executor/tp_kv.py names.
    kv_peer_tp_size: int = 0

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(
                f"device {self.device!r} is not supported; supported devices: {', '.join(DEVICES)}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.cuda_graph_max_bs < 1:
            raise ValueError("cuda_graph_max_bs must be >= 1")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.radix_eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"radix_eviction_policy must be one of {EVICTION_POLICIES}, "
                f"got {self.radix_eviction_policy!r}"
            )
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError("max_total_tokens must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            # Every request waits a moment before it runs: a limit of 0 would refuse them all.
            raise ValueError("max_queued_requests must be >= 1 (unset for no limit)")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        if not self.stream_interval_ms >= 0:
            raise ValueError("stream_interval_ms must be >= 0")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        object.__setattr__(self, "role", Role(self.role))  # a str from YAML or the CLI becomes the enum
        self._check_tiers()
        if self.kv_transfer not in KV_TRANSFER_CHOICES:
            raise ValueError(f"kv_transfer must be one of {KV_TRANSFER_CHOICES}, got {self.kv_transfer!r}")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError("kv_transfer_timeout_s must be > 0")
        if not self.step_watchdog_s > 0:
            raise ValueError("step_watchdog_s must be > 0")
        ParallelConfig(self.tp_size, self.ep_size)  # raises for sizes without a layout
        if self.kv_peer_tp_size < 0:
            raise ValueError("kv_peer_tp_size must be >= 0")
        if self.deterministic:
            self._check_deterministic()
        self._check_kv_cache_dtype()
        self._check_quantization()
        self._check_lora()

    @property
    def decodes(self) -> bool:
        """Whether this replica decodes more than a first token per request (not a prefill one)."""
        return self.role is not Role.PREFILL

    def _check_deterministic(self) -> None:
        # A ring all-reduce's per-element order depends on the buffer size (the batch), and the GPU
        # backends have no fixed-order kernels: refuse rather than promise what does not hold.
        if self.tp_size > 1:
            raise ValueError(
                "deterministic mode needs tp_size 1 (an all-reduce's order depends on the batch)"
            )
        if self.device == "cuda":
            raise ValueError("deterministic mode runs on CPU only (device cpu or auto on a CPU host)")
        if self.attention_backend not in ("auto", "cpu"):
            raise ValueError(
                f"deterministic mode needs the cpu attention backend, not {self.attention_backend!r}"
            )

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "auto":
            return
        if self.deterministic:
            raise ValueError(
                "deterministic mode keeps the KV cache in the model's dtype (kv_cache_dtype auto)"
            )
        if self.kv_cache_dtype == "fp8_e4m3":
            # On a CPU host "auto" means the cpu backend, which kv_pool.pool_dtype refuses at start.
            if self.attention_backend in ("cpu", "torch") or (
                self.device == "cpu" and self.attention_backend == "auto"
            ):
                raise ValueError(
                    "an fp8 KV cache runs on the triton attention backend (a GPU's default; on a "
                    "CPU only in Triton's interpreter, for tests)"
                )
        elif self.device == "cuda" or self.attention_backend not in ("auto", "cpu"):
            raise ValueError("an int8 KV cache runs on the cpu attention backend (device cpu)")

    def _check_tiers(self) -> None:
        if self.hicache_host_size < 0 or self.hicache_disk_size < 0:
            raise ValueError("hicache_host_size and hicache_disk_size must be >= 0")
        if bool(self.hicache_disk_dir) != (self.hicache_disk_size > 0):
            raise ValueError("the disk tier needs both hicache_disk_dir and hicache_disk_size > 0")
        if not self.hicache_host_size:
            if self.hicache_disk_dir:
                raise ValueError("the disk tier spills from the host tier: set hicache_host_size too")
            return
        if self.disable_radix_cache:
            raise ValueError("the cache tiers sit under the radix cache: not with disable_radix_cache")
        if self.tp_size > 1:
            raise ValueError("the cache tiers run at tp_size 1 (each rank's KV would need its own copy)")

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantized_activations not in ACTIVATIONS:
            raise ValueError(
                f"quantized_activations must be one of {ACTIVATIONS}, got {self.quantized_activations!r}"
            )
        if self.quantization == "fp8" and self.quantized_activations == "int8":
            raise ValueError("quantized_activations int8 multiplies integer weights, not fp8 ones")
        if self.quantization in ("none", "auto"):
            return
        if self.deterministic:
            raise ValueError("deterministic mode runs the fixed-order bf16 GEMM, not quantized weights")

    def _check_lora(self) -> None:
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths or ()))
        _ = self.lora_adapters  # raises for a malformed entry
        if self.max_loras_per_batch < 1:
            raise ValueError("max_loras_per_batch must be >= 1")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be >= 1")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError("max_loaded_loras must be >= max_loras_per_batch")
        if not self.lora_enabled:
            return
        if self.deterministic:
            raise ValueError("deterministic mode runs fixed-order GEMMs only: not with LoRA adapters")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """lora_paths as {name: path}."""
        out: dict[str, str] = {}
        for entry in self.lora_paths:
            if not isinstance(entry, str) or not entry.strip("= "):
                raise ValueError(f"lora_paths entries are name=path or a path, not {entry!r}")
            name, sep, path = entry.partition("=")
            if not sep:
                name, path = os.path.basename(os.path.normpath(entry)), entry
            if not name or not path:
                raise ValueError(f"lora_paths entries are name=path or a path, not {entry!r}")
            if name in out:
                raise ValueError(f"lora_paths names adapter {name!r} twice")
            out[name] = path
        return out

    @property
    def loaded_loras_cap(self) -> int:
        if self.max_loaded_loras is not None:
            return self.max_loaded_loras
        return max(2 * self.max_loras_per_batch, len(self.lora_paths))

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tp_size, self.ep_size)

    @classmethod
    def from_kwargs(cls, model_path: str | None = None, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model_path=model_path, **kwargs)

    def overlap(self, device_kind: str = "cpu") -> bool:
        """Whether the engine overlaps host work with the forward on a `device_kind` device."""
        return DEFAULT_OVERLAP[device_kind] if self.enable_overlap is None else self.enable_overlap

    def context_cap(self, model_context_length: int) -> int:
        """The context length the engine serves: the configured one, never above the model's."""
        return min(self.context_length or model_context_length, model_context_length)

    @property
    def chunk_size(self) -> int | None:
        return (
            self.chunked_prefill_size if self.chunked_prefill_size and self.chunked_prefill_size > 0 else None
        )
