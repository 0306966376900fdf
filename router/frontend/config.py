"""The HTTP front end's configuration: frozen, validated once, handed to the ingress whole.

`HTTPConfig` is the `http` layer of the server arguments (cluster/config.py layers it with the
others); `IngressConfig` is everything one ingress replica is built from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.router.frontend.reasoning import REASONING_PARSERS
from radixserve.router.frontend.tenants import SECRET_SETTINGS, ApiKeys
from radixserve.router.frontend.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from radixserve.router.routing.policy import PolicyConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class HTTPConfig:
    """What the HTTP front end listens on, accepts, and how long it waits for a client."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # one shared tenant
    api_keys_file: str | None = None  # tenants and their keys (router/frontend/tenants.py)
    admin_api_key: str | None = None  # the key of the admin routes
    max_request_bytes: int = 16 * 1024 * 1024  # larger bodies get 413
    max_header_bytes: int = 64 * 1024  # request line + headers; more gets 431
    header_timeout_s: float = 30.0  # a request's headers must arrive within this
    body_timeout_s: float = 30.0  # longest silence while a request body is being sent
    body_total_timeout_s: float = 120.0  # a request body must arrive whole within this
    keep_alive_timeout_s: int = 60  # an idle keep-alive connection is closed after this
    tokenizer_threads: int = 4  # threads that tokenize and render chat templates (>= 2)
    log_level: str = "info"
    # How the model writes its thinking (a REASONING_PARSERS name): chat answers carry it apart
    # as `reasoning_content`, and a grammar constrains only what follows it. None: no thinking.
    reasoning_parser: str | None = None
    # How the model writes tool calls (a TOOL_CALL_PARSERS name). None: inferred from the chat
    # template where it is unambiguous (router/frontend/tool_parsers.py `infer_parser`).
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        # A bad keys file is a start-up error here, before Ray starts; the ingress reads the file
        # again, at the same path on its own node (as engine replicas read model_path).
        self.api_keys()
        for name in ("max_request_bytes", "max_header_bytes", "keep_alive_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.tokenizer_threads < 2:
            raise ValueError("tokenizer_threads must be >= 2 (one is kept for small inputs)")
        for name in ("header_timeout_s", "body_timeout_s", "body_total_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}"
            )

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"
            )

    def api_keys(self) -> ApiKeys:
        return ApiKeys.from_settings(self.api_key, self.api_keys_file, self.admin_api_key)

    def serve_http_options(self) -> dict[str, Any]:
        """Ray Serve's `http_options` for `serve.start`: what its proxy takes as configuration.
        The header limits and read timeouts travel through `router/frontend/proxy.py` instead."""
        return {"host": self.host, "port": self.port, "keep_alive_timeout_s": self.keep_alive_timeout_s}


@dataclass(frozen=True)
class IngressConfig:
    """One ingress replica's configuration. `server_args` are all server arguments, flat, as
    `/get_server_info` reports them."""

    http: HTTPConfig
    policy: PolicyConfig
    sync_interval_s: float  # how often replicas' reports correct the routing state
    server_args: tuple[tuple[str, Any], ...]
    # PD mode: the decode pool's routing policy, and what a decode side that fails after its
    # prefill leads to (workers.protocol.PD_ON_FAILURE).
    decode_policy: PolicyConfig = PolicyConfig(policy="kv_aware")
    pd_on_failure: str = "recompute"
    pd_local_prefill_tokens: int = 0  # PD: prompts this short are prefilled on their decode replica
    # PD: how long a request may wait for a decode replica with KV room before its 503, and how
    # often the ingress renews the leases of reservations whose prefill is still on its way
    # (a third of the lease, kv_transfer_timeout_s: two renewals may be lost).
    pd_reserve_wait_s: float = 0.0
    pd_lease_renew_s: float = 10.0
    # LoRA: whether the replicas serve adapters, and those they serve from the start (name, path).
    lora_enabled: bool = False
    lora_adapters: tuple[tuple[str, str], ...] = ()

    def server_info(self) -> dict[str, Any]:
        """The flat server arguments with the key settings masked."""
        return {k: ("***" if k in SECRET_SETTINGS and v else v) for k, v in self.server_args}
