"""Server configuration: frozen layers (engine, HTTP, deployment, router), parsed from YAML or
the CLI.

One flat namespace of SGLang-style names (`max_total_tokens`, `port`, `dp`, ...) is what users
write in a YAML file, on the command line (`--max-total-tokens`) and what `build_app` receives;
`ServerArgs.from_dict` splits it into the layers each component reads, and rejects unknown names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from radixserve.router.frontend.config import LOG_LEVELS, HTTPConfig, IngressConfig
from radixserve.router.frontend.reasoning import REASONING_PARSERS
from radixserve.router.frontend.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from radixserve.router.routing.policy import POLICY_NAMES, PolicyConfig
from radixserve.workers.engine.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    KV_CACHE_DTYPES,
    SCHEDULE_POLICIES,
    EngineConfig,
)
from radixserve.workers.protocol import KV_TRANSFER_CHOICES, PD_ON_FAILURE, Role

# Engine fields the application builder sets per deployment; no user sets them.
INTERNAL_FIELDS = frozenset({"role", "kv_peer_tp_size"})

# --tp-placement -> the placement group strategy of a tensor-parallel replica's bundles.
TP_PLACEMENTS = {"strict_pack": "STRICT_PACK", "pack": "PACK"}
# Short names, as SGLang spells them (`--tp 2`), for the fields they stand for.
ALIASES = {"dp_size": "dp", "tp": "tp_size", "ep": "ep_size"}


@dataclass(frozen=True)
class DeploymentConfig:
    """How the Serve application is laid out on the Ray cluster."""

    dp: int = 1  # engine replicas
    replica_num_cpus: float | None = None  # Ray CPUs per engine replica (per rank); None: a node's share
    # Memory per engine replica: Ray's `memory` resource (a node takes only the replicas it has
    # room for) and, on CPU, the cap on the replica's growth past start-up that the kernel
    # enforces (executor/memory_limit.py). None: no reservation, and a cap of half the node's RAM.
    replica_memory_gb: float | None = None
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.0  # the ingress is I/O bound; it must not starve the engines
    # Serve's cap on one replica's requests in flight, ingress and engine replicas alike. The
    # engine, not Serve, is the queue (max_queued_requests answers 503): this cap must not bind first.
    max_ongoing_requests: int = 4096
    app_name: str = "radixserve"
    ray_address: str | None = None  # None: RAY_ADDRESS or a new local instance
    ray_metrics_export_port: int | None = None  # a Ray this command starts: its metrics port
    # Where a tensor-parallel replica's ranks go (one placement group bundle each): all on one
    # node (strict_pack), or packed but free to span nodes (pack).
    tp_placement: str = "strict_pack"
    # PD disaggregation: a prefill pool and a decode pool instead of `dp` unified replicas.
    pd: bool = False
    prefill_replicas: int = 1
    decode_replicas: int = 1
    prefill_num_cpus: float | None = None  # Ray CPUs per replica; None: a node's share
    decode_num_cpus: float | None = None
    # Each pool's tensor-parallel degree; None: --tp. They may differ (executor/tp_kv.py plans
    # which ranks move which heads).
    prefill_tp: int | None = None
    decode_tp: int | None = None
    # Ray custom resources each replica of a pool asks for (ray_actor_options.resources, and each
    # rank's bundle): a pool lands only on the nodes that advertise them (deploy/cluster-aws.yaml's
    # `prefill_pool` / `decode_pool` node types). None: any node with the CPUs and GPUs.
    prefill_resources: dict[str, float] | None = None
    decode_resources: dict[str, float] | None = None
    pd_on_failure: str = "recompute"
    # PD: a prompt of at most this many tokens is prefilled on its decode replica instead (0: every
    # prompt goes through the prefill pool).
    pd_local_prefill_tokens: int = 0
    # PD: a request that finds no decode replica with KV room for it waits up to this long for one
    # (another replica is tried, then room is waited for) before it is refused with 503.
    pd_reserve_wait_s: float = 5.0

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError("dp must be >= 1")
        if self.tp_placement not in TP_PLACEMENTS:
            raise ValueError(f"tp_placement must be one of {tuple(TP_PLACEMENTS)}, got {self.tp_placement!r}")
        if self.prefill_replicas < 1 or self.decode_replicas < 1:
            raise ValueError("prefill_replicas and decode_replicas must be >= 1")
        for name in ("prefill_num_cpus", "decode_num_cpus"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("prefill_tp", "decode_tp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("prefill_resources", "decode_resources"):
            _check_resources(name, getattr(self, name))
        if self.pd_on_failure not in PD_ON_FAILURE:
            raise ValueError(f"pd_on_failure must be one of {PD_ON_FAILURE}, got {self.pd_on_failure!r}")
        if self.pd_local_prefill_tokens < 0:
            raise ValueError("pd_local_prefill_tokens must be >= 0")
        if not 0 <= self.pd_reserve_wait_s <= MAX_RESERVE_WAIT_S:
            raise ValueError(f"pd_reserve_wait_s must be in [0, {MAX_RESERVE_WAIT_S:g}]")
        if self.ingress_replicas < 1:
            raise ValueError("ingress_replicas must be >= 1")
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        if (self.replica_num_cpus is not None and self.replica_num_cpus < 0) or self.ingress_num_cpus < 0:
            raise ValueError("num_cpus must be >= 0")
        if self.replica_memory_gb is not None and not self.replica_memory_gb > 0:
            raise ValueError("replica_memory_gb must be > 0")
        if self.ray_metrics_export_port is not None and not 0 < self.ray_metrics_export_port < 65536:
            raise ValueError(
                f"ray_metrics_export_port must be in 1..65535, got {self.ray_metrics_export_port}"
            )


# A client waits this long at most for KV room before its 503 (it holds an HTTP request open).
MAX_RESERVE_WAIT_S = 60.0

# Resources Ray schedules on its own terms: a replica asks for them through num_cpus / num_gpus
# (or the device), never as custom resources.
BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def _check_resources(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{name} must be a non-empty mapping of resource name to amount")
    for key, amount in value.items():
        if not isinstance(key, str) or not key or key in BUILTIN_RESOURCES:
            raise ValueError(f"{name}: {key!r} is not a custom resource name (CPUs and GPUs are set apart)")
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount <= 0:
            raise ValueError(f"{name}[{key!r}] must be a number > 0, got {amount!r}")


_POLICY = PolicyConfig()  # the policy knobs' defaults live there


@dataclass(frozen=True)
class RouterConfig:
    """How the ingress chooses an engine replica (router/routing/policy.py, router/routing/request_router.py)."""

    router_policy: str | None = None  # None: cache_aware with dp > 1, else round_robin
    cache_threshold: float = _POLICY.cache_threshold
    min_match_tokens: int = _POLICY.min_match_tokens
    load_cost_tokens: int = _POLICY.load_cost_tokens
    balance_abs_threshold: int = _POLICY.balance_abs_threshold
    balance_rel_threshold: float = _POLICY.balance_rel_threshold
    lower_tier_weight: float = _POLICY.lower_tier_weight
    lora_affinity_load: int = _POLICY.lora_affinity_load
    router_sync_interval_s: float = 5.0  # how often replicas' caches and loads correct the policy

    def __post_init__(self) -> None:
        PolicyConfig(**self.policy_kwargs("cache_aware"))  # the policy's own validation
        if self.router_sync_interval_s <= 0:
            raise ValueError("router_sync_interval_s must be > 0")

    def policy_kwargs(self, default_policy: str) -> dict[str, Any]:
        """PolicyConfig fields (JSON-able: Serve passes them to the request router)."""
        return {
            "policy": self.router_policy or default_policy,
            "cache_threshold": self.cache_threshold,
            "min_match_tokens": self.min_match_tokens,
            "load_cost_tokens": self.load_cost_tokens,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
            "lower_tier_weight": self.lower_tier_weight,
            "lora_affinity_load": self.lora_affinity_load,
        }


@dataclass(frozen=True)
class AutoscaleConfig:
    """Replica autoscaling (cluster/autoscaling.py), per engine role: on when the role's max
    replicas exceed its min; otherwise the role's replica count is fixed (--dp for unified)."""

    min_replicas: int = 1  # unified engine replicas
    max_replicas: int | None = None
    prefill_min_replicas: int = 1
    prefill_max_replicas: int | None = None
    decode_min_replicas: int = 1
    decode_max_replicas: int | None = None
    autoscale_target_queued_tokens: int | None = None  # per replica; None: max_prefill_tokens
    autoscale_target_kv_usage: float = 0.8
    autoscale_target_running: int | None = None  # per replica; None: 3/4 of max_running_requests
    # Latency targets in seconds (prefill and unified: time to first token; decode and unified:
    # inter-token latency); None: latency is no signal.
    autoscale_target_ttft_s: float | None = None
    autoscale_target_itl_s: float | None = None
    autoscale_upscale_delay_s: float = 30.0
    autoscale_downscale_delay_s: float = 600.0
    autoscale_look_back_s: float = 30.0  # Serve averages each replica's metrics over this window
    autoscale_metrics_interval_s: float = 10.0  # how often replicas push their metrics
    drain_timeout_s: float = (
        300.0  # a replica being removed (or a stopped server) finishes its requests within this
    )

    def __post_init__(self) -> None:
        for role in ("", "prefill_", "decode_"):
            lo, hi = getattr(self, f"{role}min_replicas"), getattr(self, f"{role}max_replicas")
            if lo < 1:  # the ingress asks a replica for the model card when it starts
                raise ValueError(f"{role}min_replicas must be >= 1")
            if hi is not None and hi < lo:
                raise ValueError(f"{role}max_replicas must be >= {role}min_replicas")
        for name in ("autoscale_target_queued_tokens", "autoscale_target_running"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("autoscale_target_ttft_s", "autoscale_target_itl_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 < self.autoscale_target_kv_usage <= 1:
            raise ValueError("autoscale_target_kv_usage must be in (0, 1]")
        if min(self.autoscale_upscale_delay_s, self.autoscale_downscale_delay_s, self.drain_timeout_s) < 0:
            raise ValueError("autoscaling delays and drain_timeout_s must be >= 0")
        if not 0 < self.autoscale_metrics_interval_s < self.autoscale_look_back_s:
            raise ValueError("autoscale_metrics_interval_s must be > 0 and < autoscale_look_back_s")

    def bounds(self, role: Role) -> tuple[int, int] | None:
        """(min, max) replicas of `role`; None: not autoscaled."""
        role = Role(role)
        prefix = "" if role is Role.UNIFIED else f"{role.value}_"
        lo, hi = getattr(self, f"{prefix}min_replicas"), getattr(self, f"{prefix}max_replicas")
        return (lo, hi) if hi is not None and hi > lo else None


LAYERS: dict[str, type] = {
    "engine": EngineConfig,
    "http": HTTPConfig,
    "deployment": DeploymentConfig,
    "router": RouterConfig,
    "autoscale": AutoscaleConfig,
}


@dataclass(frozen=True)
class ServerArgs:
    engine: EngineConfig = field(default_factory=EngineConfig)
    http: HTTPConfig = field(default_factory=HTTPConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)

    def __post_init__(self) -> None:
        if self.deployment.pd:  # the engine's own rules for the roles the app builder will give it
            for role in (Role.PREFILL, Role.DECODE):
                self.role_engine(role)
        elif self.deployment.prefill_tp or self.deployment.decode_tp:
            raise ValueError("--prefill-tp and --decode-tp are PD settings (with --pd); use --tp")
        elif self.deployment.prefill_resources or self.deployment.decode_resources:
            raise ValueError("--prefill-resources and --decode-resources are PD settings (with --pd)")

    def tp_of(self, role: Role) -> int:
        """The tensor-parallel degree of `role`'s replicas."""
        role = Role(role)
        d = self.deployment
        per_role = {Role.PREFILL: d.prefill_tp, Role.DECODE: d.decode_tp}.get(role)
        return per_role or self.engine.tp_size

    def role_engine(self, role: Role) -> EngineConfig:
        """The engine config of `role`'s replicas: its degree, and for decode the prefill pool's."""
        role = Role(role)
        peer = self.tp_of(Role.PREFILL) if role is Role.DECODE else 0
        return dataclasses.replace(self.engine, role=role, tp_size=self.tp_of(role), kv_peer_tp_size=peer)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None = None) -> ServerArgs:
        """Build from one flat dict of field names (hyphens allowed); unknown names are an error."""
        flat = {str(k).replace("-", "_"): v for k, v in (d or {}).items()}
        for alias, name in ALIASES.items():
            if alias in flat:
                flat[name] = flat.pop(alias)
        owner = {
            f.name: layer
            for layer, c in LAYERS.items()
            for f in dataclasses.fields(c)
            if f.name not in INTERNAL_FIELDS
        }
        unknown = sorted(set(flat) - set(owner))
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        parts: dict[str, dict[str, Any]] = {layer: {} for layer in LAYERS}
        for name, value in flat.items():
            parts[owner[name]][name] = value
        return cls(**{layer: LAYERS[layer](**kw) for layer, kw in parts.items()})

    @classmethod
    def from_yaml(cls, path: str, overrides: dict[str, Any] | None = None) -> ServerArgs:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of server arguments")
        return cls.from_dict({**data, **(overrides or {})})

    def to_dict(self) -> dict[str, Any]:
        """The flat dict `from_dict` reads (what `build_app` takes)."""
        out: dict[str, Any] = {}
        for layer in LAYERS:
            out.update(dataclasses.asdict(getattr(self, layer)))
        for name in INTERNAL_FIELDS:
            out.pop(name, None)
        return out

    def policy_kwargs(self) -> dict[str, Any]:
        """The routing policy's config: cache_aware is the default once there is a choice."""
        choice = self.deployment.dp > 1 or self.autoscale.bounds(Role.UNIFIED) is not None
        return self.router.policy_kwargs("cache_aware" if choice else "round_robin")

    def prefill_policy_kwargs(self) -> dict[str, Any]:
        """PD: the prefill pool is routed like a unified one (cache-aware once there is a choice)."""
        choice = self.deployment.prefill_replicas > 1 or self.autoscale.bounds(Role.PREFILL) is not None
        return self.router.policy_kwargs("cache_aware" if choice else "round_robin")

    def decode_policy_kwargs(self) -> dict[str, Any]:
        """PD: the decode pool is routed by KV room, then its held conversations and load
        (router/routing/policy.py: KVAwarePolicy)."""
        return {**self.router.policy_kwargs("kv_aware"), "policy": "kv_aware"}

    def ingress_config(self) -> IngressConfig:
        pd = self.deployment.pd
        return IngressConfig(
            http=self.http,
            policy=PolicyConfig(**(self.prefill_policy_kwargs() if pd else self.policy_kwargs())),
            sync_interval_s=self.router.router_sync_interval_s,
            server_args=tuple(self.to_dict().items()),
            decode_policy=PolicyConfig(**self.decode_policy_kwargs()),
            pd_on_failure=self.deployment.pd_on_failure,
            pd_local_prefill_tokens=self.deployment.pd_local_prefill_tokens,
            pd_reserve_wait_s=self.deployment.pd_reserve_wait_s,
            pd_lease_renew_s=self.engine.kv_transfer_timeout_s / 3,
            lora_enabled=self.engine.lora_enabled,
            lora_adapters=tuple(self.engine.lora_adapters.items()),
        )

    @property
    def url(self) -> str:
        host = self.http.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)
        return f"http://{shown}:{self.http.port}"


HELP = {
    "model_path": "HF directory, .gguf file, or unset for the embedded SmolLM2-135M-Instruct",
    "served_model_name": "the model name clients send (default: derived from the model path)",
    "dtype": "auto | bfloat16 | float32 | float16",
    "quantization": "quantized weights: auto (gguf for a .gguf model on the CPU with --dtype auto, else none) | "
    "none | int8 (weight-only, per-output-channel scales, quantized at load) | fp8 (e4m3, likewise; "
    "torch._scaled_mm on GPUs with fp8 tensor cores, dequantized elsewhere) | "
    "gguf (a .gguf model computed from its own blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); AWQ / GPTQ / "
    "compressed-tensors / fp8 (per-tensor or per-channel scales) checkpoints run from their packed values under none",
    "quantized_activations": "how quantized weights multiply decode rows: float (exact up to summation order) | "
    "int8 (rows rounded to int8 per block of 32, integer products: faster)",
    "device": "where the engines run: auto (cuda where the cluster has GPUs, else cpu) | cpu | cuda "
    "(one GPU per replica, per rank with --tp)",
    "attention_backend": "auto (cpu on CPU, triton on CUDA) | cpu (fused C++) | triton (paged Triton "
    "kernels) | torch (flash-attn varlen or SDPA) | torch_ref (slow reference)",
    "kv_cache_dtype": "the KV cache's element type: auto (the model's dtype) | int8 (a token's head in int8 with "
    "a float32 scale of its own: 0.53x bf16's bytes at head size 64; bf16 models on the cpu attention backend "
    "of AVX512-BF16 CPUs) | fp8_e4m3 (e4m3 with a scale per layer, the checkpoint's k_scale / v_scale or 1.0; "
    "the triton attention backend, a GPU's default)",
    "disable_cuda_graph": "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs",
    "cuda_graph_max_bs": "CUDA: largest decode batch replayed from a CUDA graph (larger ones run eagerly)",
    "context_length": "maximum prompt + completion tokens (default: the model's)",
    "mem_fraction_static": "share of memory for weights and the KV pool",
    "max_total_tokens": "KV pool size in tokens (wins over --mem-fraction-static)",
    "max_running_requests": "maximum requests in the running batch per replica",
    "max_queued_requests": "waiting-queue limit per replica, in sequences (a request with n=8 "
    "counts 8); beyond it requests get 503",
    "chunked_prefill_size": "prefill chunk size in tokens (-1 disables chunking)",
    "enable_mixed_chunk": "a prefill step also carries every running decode (decodes never wait "
    "behind a prefill; a failing forward then fails the decodes of its step too; load_tests/bench_mixed.py)",
    "mixed_step_ratio": "a mixed step carries as many prefill tokens as keep it near this many decode "
    "steps' time, learned from the steps run: bounds the decodes' inter-token latency while prompts "
    "arrive, at the price of their TTFT (2.5: ITL p99 / p50 under 3; <= 1: the whole chunk)",
    "schedule_policy": " | ".join(SCHEDULE_POLICIES),
    "disable_radix_cache": "turn prefix caching off",
    "deterministic": "batch-invariant kernels: a seeded request gives bitwise the same tokens whatever "
    "else runs (CPU, bf16, --tp 1; load_tests/bench_deterministic.py measures the throughput)",
    "hicache_host_size": "GiB of host memory that KV evicted from the device pool moves to (0: none); "
    "a prompt that matches it copies it back instead of recomputing it (unified mode, --tp 1)",
    "hicache_disk_dir": "directory for a third cache tier on local disk: host-tier KV spills to files "
    "there (checksummed; a bad file is recomputed); each replica uses a subdirectory it removes",
    "hicache_disk_size": "GiB the disk tier may use (needs --hicache-disk-dir and --hicache-host-size)",
    "enable_lora": "serve LoRA adapters (also without --lora-paths: adapters loaded at run time "
    "through POST /load_lora_adapter); unified replicas, --tp 1",
    "lora_paths": "LoRA adapters (PEFT directories) served from the start, as name=path (or a path, "
    "named after its directory); a request picks one by its model name",
    "max_loras_per_batch": "most adapters one batch mixes (their requests run together; others wait)",
    "max_lora_rank": "largest adapter rank served (default: the largest of --lora-paths, at least 16)",
    "max_loaded_loras": "adapters kept in memory per replica, the least recently used dropped beyond "
    "it and read again when asked (default: twice --max-loras-per-batch)",
    "radix_eviction_policy": "lru (least recently used leaf first) | lfu (least used, then least "
    "recently used: one-off suffixes go before shared prefixes)",
    "api_key": "require 'Authorization: Bearer <key>' on every endpoint except /health and /ready "
    "(one shared tenant; its key opens the admin routes unless --admin-api-key is set)",
    "api_keys_file": "YAML/JSON mapping of tenant name to key or list of keys ('acme: sk-1' lines); "
    "each tenant gets its own prefix cache, routing and request ids (not with --api-key)",
    "admin_api_key": "the key of the admin routes (/flush_cache), and of aborting any request "
    "('<tenant>/<rid>')",
    "max_request_bytes": "largest request body; beyond it 413",
    "max_header_bytes": "largest request line + headers; beyond it 431",
    "header_timeout_s": "a connection that has not sent a request's full headers in this time is closed",
    "body_timeout_s": "a request body that pauses longer than this is dropped (408)",
    "step_watchdog_s": "a piece of the engine thread's work still running after this long is logged "
    "with the request(s) it serves",
    "body_total_timeout_s": "a request body not received whole this long after its headers is dropped "
    "(408), however steadily it trickles in",
    "keep_alive_timeout_s": "idle keep-alive connections are closed after this",
    "tokenizer_threads": "threads that tokenize prompts and render chat templates (off the event loop)",
    "dp": "number of engine replicas (data parallel)",
    "tp_size": "tensor parallelism: ranks per engine replica, each with its shard of the model and its "
    "own KV heads (a placement group of one bundle per rank)",
    "ep_size": "expert parallelism: a MoE model's experts spread over this many groups of the "
    "replica's ranks (divides --tp)",
    "tp_placement": "strict_pack (a replica's ranks on one node) | pack (packed, may span nodes)",
    "max_ongoing_requests": "Serve's cap on one replica's requests in flight (keep it above the engine's "
    "running + queued limits)",
    "replica_num_cpus": "Ray CPUs per engine replica (per rank with --tp), also its torch threads "
    "(default: the smallest node's CPUs split among the replicas' ranks it must hold)",
    "replica_memory_gb": "memory per engine replica: reserved from Ray, and on CPU the most the "
    "replica may grow past its start-up size before its allocations fail (default: no reservation, "
    "half the node's RAM)",
    "min_replicas": "autoscaling: fewest engine replicas (autoscaling is on when --max-replicas exceeds "
    "it; --dp is then the initial count)",
    "max_replicas": "autoscaling: most engine replicas",
    "prefill_min_replicas": "PD autoscaling: fewest prefill replicas",
    "prefill_max_replicas": "PD autoscaling: most prefill replicas (on when above the min)",
    "decode_min_replicas": "PD autoscaling: fewest decode replicas",
    "decode_max_replicas": "PD autoscaling: most decode replicas (on when above the min)",
    "autoscale_target_queued_tokens": "autoscaling: prompt tokens waiting to be prefilled per replica "
    "(prefill and unified replicas; default: --max-prefill-tokens)",
    "autoscale_target_kv_usage": "autoscaling: share of the KV pool held by requests per replica "
    "(decode and unified replicas)",
    "autoscale_target_running": "autoscaling: running sequences per replica (decode and unified "
    "replicas; default: 3/4 of --max-running-requests)",
    "autoscale_target_ttft_s": "autoscaling: mean time to first token per replica, in seconds, that "
    "adds prefill (and unified) replicas when exceeded (default: latency is no signal)",
    "autoscale_target_itl_s": "autoscaling: mean inter-token latency per replica, in seconds, that "
    "adds decode (and unified) replicas when exceeded (default: latency is no signal)",
    "autoscale_upscale_delay_s": "autoscaling: how long the load must stay above the targets before "
    "replicas are added",
    "autoscale_downscale_delay_s": "autoscaling: how long the load must stay below the targets (with a "
    "margin) before one replica is removed",
    "autoscale_look_back_s": "autoscaling: window over which each replica's load is averaged",
    "autoscale_metrics_interval_s": "autoscaling: how often replicas report their load",
    "drain_timeout_s": "a replica being removed, or the server on SIGTERM / Ctrl-C, stops taking "
    "requests and finishes those in flight within this time",
    "log_level": " | ".join(LOG_LEVELS),
    "reasoning_parser": "how the model writes its thinking: chat answers carry it apart as "
    "reasoning_content, and structured output constrains only the answer after it ("
    + " | ".join(REASONING_PARSERS)
    + ")",
    "tool_call_parser": "how the model writes tool calls, parsed into the chat API's tool_calls ("
    + " | ".join(TOOL_CALL_PARSERS)
    + "; qwen is hermes; default: inferred from the chat template where unambiguous)",
    "ray_address": "join this Ray cluster instead of starting a local one (also RAY_ADDRESS)",
    "ray_metrics_export_port": "port of Ray's Prometheus metrics (Serve's replicas, queues, autoscaling) "
    "when this command starts Ray (on 127.0.0.1; default: a free port)",
    "router_policy": f"replica choice: {' | '.join(POLICY_NAMES)} (default: cache_aware if dp > 1)",
    "cache_threshold": "cache_aware: prefix match rate above which the matching replica wins",
    "min_match_tokens": "cache_aware: ... and prefix match length (tokens) below which a match "
    "never counts (a chat template's shared header is no reason to queue behind others)",
    "load_cost_tokens": "cache_aware: matched tokens that pay for each request the matching "
    "replica carries beyond the least loaded one (0: load never outweighs a match)",
    "balance_abs_threshold": "cache_aware: imbalanced if max load - min load exceeds this ...",
    "balance_rel_threshold": "... and max load exceeds min load times this",
    "lower_tier_weight": "cache_aware: what a prefix held in a replica's host or disk cache tier "
    "is worth against one on its device (0..1; --hicache-host-size)",
    "lora_affinity_load": "cache_aware: on a cache miss, a replica holding the request's LoRA adapter "
    "in memory wins while it carries at most this many requests more than the least loaded",
    "router_sync_interval_s": "seconds between replica cache/load reports to the router",
    "pd": "prefill/decode disaggregation: a prefill pool and a decode pool (instead of --dp), "
    "the KV moving from one to the other",
    "prefill_replicas": "PD: prefill replicas",
    "decode_replicas": "PD: decode replicas",
    "prefill_num_cpus": "PD: Ray CPUs per prefill replica (default: a node's share)",
    "decode_num_cpus": "PD: Ray CPUs per decode replica (default: a node's share)",
    "prefill_tp": "PD: tensor-parallel ranks per prefill replica (default: --tp); may differ from "
    "the decode pool's: each decode rank takes each of its KV heads from one prefill rank",
    "decode_tp": "PD: tensor-parallel ranks per decode replica (default: --tp)",
    "prefill_resources": "PD: Ray custom resources per prefill replica (and rank), as JSON: "
    "'{\"prefill_pool\": 0.01}' places the pool on the nodes that advertise them",
    "decode_resources": "PD: Ray custom resources per decode replica (and rank), as JSON",
    "pd_on_failure": "PD: a decode side that fails after the prefill: recompute the rest on one "
    "replica, or end the request with an error",
    "pd_local_prefill_tokens": "PD: prompts of at most this many tokens are prefilled on their decode "
    "replica, skipping the prefill pool and the transfer (0: none are)",
    "kv_transfer": "PD: how KV moves from prefill to decode: auto (nccl on GPU, gloo on CPU) | gloo "
    "| nccl | ray (the object store)",
    "kv_transfer_timeout_s": "PD: a transfer not complete within this frees its slots on both sides; "
    "also the lease of a decode reservation, which the ingress renews while its prefill is queued",
    "pd_reserve_wait_s": "PD: how long a request waits for a decode replica with KV room (trying "
    "another, then waiting for room) before it is refused with 503",
}


def _value_type(annotation: str) -> Callable[[str], Any]:
    """The parser of a field annotation written as a string (`int | None` -> int); a mapping
    (`dict[str, float] | None`) is given as JSON on the command line."""
    parts = [p.strip() for p in annotation.split("|") if p.strip() != "None"]
    inner = parts[0] if len(parts) == 1 else "str"
    if inner.startswith("dict["):
        return json.loads
    return {"bool": bool, "int": int, "float": float}.get(inner, str)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag-name` per field of every layer; defaults stay unset so YAML values can win."""
    for layer, cls in LAYERS.items():
        group = parser.add_argument_group(layer)
        for f in dataclasses.fields(cls):
            if f.name in INTERNAL_FIELDS:
                continue
            flag = "--" + f.name.replace("_", "-")
            names = [flag] + ["--" + a.replace("_", "-") for a, n in ALIASES.items() if n == f.name]
            kind = _value_type(str(f.type))  # annotations are strings (postponed evaluation)
            help_text = HELP.get(f.name, "")
            if str(f.type).startswith("tuple["):  # a list of values: --flag a b c
                group.add_argument(*names, dest=f.name, nargs="+", default=None, help=help_text)
            elif kind is bool:
                group.add_argument(
                    *names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
                )
            else:
                choices = {
                    "schedule_policy": SCHEDULE_POLICIES,
                    "device": DEVICES,
                    "attention_backend": ATTENTION_BACKENDS,
                    "log_level": LOG_LEVELS,
                    "reasoning_parser": REASONING_PARSERS,
                    "tool_call_parser": TOOL_CALL_PARSERS,
                    "router_policy": POLICY_NAMES,
                    "tp_placement": tuple(TP_PLACEMENTS),
                    "kv_transfer": KV_TRANSFER_CHOICES,
                    "pd_on_failure": PD_ON_FAILURE,
                    "kv_cache_dtype": KV_CACHE_DTYPES,
                }.get(f.name)
                group.add_argument(
                    *names,
                    dest=f.name,
                    type=kind,
                    default=None,
                    choices=choices,
                    help=f"{help_text} (default: {f.default})".strip(),
                )


def parse_cli(argv: Sequence[str] | None = None) -> ServerArgs:
    """`radixserve serve` arguments: an optional --config YAML, then flags that override it."""
    parser = argparse.ArgumentParser(prog="radixserve serve")
    parser.add_argument("--config", help="YAML file of server arguments (flags override it)")
    add_cli_args(parser)
    ns = vars(parser.parse_args(argv))
    config = ns.pop("config")
    given = {k: v for k, v in ns.items() if v is not None}
    try:
        return ServerArgs.from_yaml(config, given) if config else ServerArgs.from_dict(given)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
