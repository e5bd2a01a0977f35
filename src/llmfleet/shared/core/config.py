"""Configuration: frozen dataclasses, validated on construction, one env-variable prefix.

Every field of a config part can be set from the environment as `LLMFLEET_<FIELD>` (engine) or
`LLMFLEET_<SECTION>_<FIELD>` (service parts, SECTION = the class's ENV_SECTION, e.g.
`LLMFLEET_WORKER_PORT`); CLI flags override the environment. `from_env` reads the registry;
nothing else in the code base reads `LLMFLEET_*` variables directly.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from llmfleet.shared.core.api_keys import KeyRing

# The engine's part lives in its own module; importers may take it from here with the others.
from llmfleet.shared.core.engine_config import EngineConfig as EngineConfig
from llmfleet.shared.core.errors import ValidationError

ENV_PREFIX = "LLMFLEET_"
T = TypeVar("T")

# Messages between services may be this large (shared/wire/limits.py); a public port's limit
# may not exceed it, so what a public port accepts never fails an internal hop for its size.
INTERNAL_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The longest a KV lease may live (a worker refuses a ReserveKV asking for more).
MAX_LEASE_TTL_MS = 10 * 60 * 1000


ROUTING_POLICIES = ("round_robin", "least_load", "prefix_aware", "predicted_ttft")
WORKER_ROLES = ("unified", "prefill", "decode")


@dataclass(frozen=True)
class TokenizerConfig:
    ENV_SECTION: typing.ClassVar[str] = "TOKENIZER"
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    metrics_port: int = 0
    model: str | None = None  # tokenizer of this model (None: the bundled SmolLM2)
    # Mutual TLS on internal gRPC, CURVE on ZMQ, with the credentials in this directory
    # (shared/wire/tls.py; `llmfleet tls init DIR`); None: plaintext.
    tls_dir: str | None = None
    # Images of a vision-language model (text/media.py): `data:` URIs and inline bytes always;
    # local files only under this directory (None: none); http(s) URLs only when allowed.
    allowed_media_dir: str | None = None
    allow_remote_media: bool = False
    max_image_bytes: int = 20 * 1024 * 1024  # encoded bytes of one image
    max_image_pixels: int = 32 * 1024 * 1024  # width x height, checked before decoding
    limit_images_per_prompt: int = 8
    # The media store (shared/wire/media.py): preprocessed pixels kept for workers to fetch,
    # at most this many MiB, LRU; served over ZMQ on `media_port` of `host` (0: a free port).
    media_store_mb: int = 1024
    media_port: int = 0

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "media_store_mb"):
            if getattr(self, name) <= 0:
                raise ValidationError(name, f"must be > 0, got {getattr(self, name)}")
        if self.limit_images_per_prompt < 0:
            raise ValidationError("limit_images_per_prompt", "must be >= 0")
        if not 0 <= self.media_port < 65536:
            raise ValidationError("media_port", f"must be in [0, 65535], got {self.media_port}")


@dataclass(frozen=True)
class RouterConfig:
    ENV_SECTION: typing.ClassVar[str] = "ROUTER"
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0
    tokenizer_address: str = "127.0.0.1:50052"
    mode: str = "aggregated"  # aggregated | disaggregated
    routing_policy: str = "prefix_aware"
    # prefix_aware: prefer the worker with the longest cached prefix unless its load exceeds
    # the least-loaded worker's by more than this many running+waiting sequences.
    prefix_load_threshold: int = 4
    # disaggregated: prompts shorter than this are prefilled by the decode worker itself.
    short_prompt_threshold: int = 32
    heartbeat_interval_ms: int = 1000
    # A worker silent this long (no heartbeat, no streamed output) is dropped. Generous: a
    # starved CPU delays heartbeats, and a dead worker is caught sooner by its lost connection.
    heartbeat_timeout_ms: int = 10000
    lease_ttl_ms: int = 30000
    max_retries: int = 1  # re-submissions of a request after a worker failure
    # disaggregated: KV handoffs (reserve, prefill, push) in flight per prefill worker; more
    # wait their turn in the router, so decode KV is not held by leases a queue has not reached.
    max_prefills_per_worker: int = 8
    max_queued_requests: int = 1024  # beyond: RESOURCE_EXHAUSTED
    # The largest Generate request (bytes of its protobuf) the public port takes; beyond:
    # RESOURCE_EXHAUSTED naming the limit. At most INTERNAL_MAX_MESSAGE_BYTES.
    max_message_bytes: int = 32 * 1024 * 1024
    # The kvstore's gRPC address and KV-event endpoint: with both, the router keeps a view of
    # what the store holds, and routing counts a prefix there as fetched, not recomputed.
    kvstore_address: str | None = None
    kvstore_events_endpoint: str | None = None
    grace_s: float = 30.0  # on SIGTERM: running streams finish for this long, then close
    # The internal side (worker Registry, the reply PULL endpoint) binds here, apart from the
    # public `host`. `internal_port` None: the Registry shares the public port (plaintext only).
    internal_host: str = "127.0.0.1"
    internal_port: int | None = None
    # Workers reach the router's reply endpoint at this host (a pod's IP); None: internal_host,
    # or this machine's address when that is a wildcard (shared/wire/transport.reachable_host).
    advertise_host: str | None = None
    # Mutual TLS on internal gRPC, CURVE on ZMQ, with the credentials in this directory
    # (shared/wire/tls.py; `llmfleet tls init DIR`); None: plaintext.
    tls_dir: str | None = None
    # The Envoy ext_proc v3 endpoint picker (router/epp.py) on this port of `host`; None: off.
    # It names `<worker host>:<epp_target_port>`, the HTTP server beside each worker (a pod's
    # gateway sidecar).
    epp_port: int | None = None
    epp_target_port: int = 8000

    def __post_init__(self) -> None:
        if self.grace_s < 0:
            raise ValidationError("grace_s", "must be >= 0")
        if self.epp_port is not None and not 0 <= self.epp_port < 65536:
            raise ValidationError("epp_port", f"must be in [0, 65535], got {self.epp_port}")
        if not 0 < self.epp_target_port < 65536:
            raise ValidationError(
                "epp_target_port", f"must be in [1, 65535], got {self.epp_target_port}"
            )
        if self.tls_dir is not None and self.internal_port is None:
            raise ValidationError(
                "internal_port", "tls_dir needs an internal port: the public one stays plaintext"
            )
        if (self.kvstore_address is None) != (self.kvstore_events_endpoint is None):
            raise ValidationError(
                "kvstore_events_endpoint", "kvstore_address and kvstore_events_endpoint go together"
            )
        if self.mode not in ("aggregated", "disaggregated"):
            raise ValidationError("mode", f"must be aggregated or disaggregated, got {self.mode}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValidationError("routing_policy", f"must be one of {', '.join(ROUTING_POLICIES)}")
        if self.max_prefills_per_worker < 1:
            raise ValidationError("max_prefills_per_worker", "must be >= 1")
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms:
            raise ValidationError("heartbeat_timeout_ms", "must exceed heartbeat_interval_ms")
        if not 1024 <= self.max_message_bytes <= INTERNAL_MAX_MESSAGE_BYTES:
            raise ValidationError(
                "max_message_bytes", f"must be in [1024, {INTERNAL_MAX_MESSAGE_BYTES}]"
            )
        _check_lease_ttl(self.lease_ttl_ms)


@dataclass(frozen=True)
class WorkerConfig:
    ENV_SECTION: typing.ClassVar[str] = "WORKER"
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    role: str = "unified"  # unified | prefill | decode
    worker_id: str | None = None  # None: derived from host, port and pid
    router_address: str | None = None  # Registry to register with (None: standalone)
    # The host in the address this worker registers and in its ZMQ endpoints (a pod's IP);
    # None: `host`, or this machine's address when that is a wildcard.
    advertise_host: str | None = None
    kvstore_address: str | None = None  # KVStore gRPC address (None: no shared KV store)
    kvstore_endpoint: str | None = None  # KVStore ZMQ data endpoint (tcp://host:port)
    # KVStore's KV-event PUB endpoint: with it the worker keeps a view of what the kvstore
    # holds and skips the lookup RPC (a TTFT hop) for prompts it holds nothing of.
    kvstore_events_endpoint: str | None = None
    # Puts of a computed prompt's blocks start this long after its first token, off that
    # token's way to the client (they are background work; a request never waits for them).
    kvstore_put_delay_ms: int = 20
    # KV bytes of puts in flight at most (copies to the host and sends); a put over it is dropped.
    kvstore_put_max_bytes: int = 1 << 30
    # CPU workers: after a step that gave a request its first token, the next step starts this
    # much later. The step would take every core, so the services carrying that token to the
    # client (router, tokenizer) would wait for the OS to preempt it. Costs one inter-token
    # interval this much, once per request; skipped while requests wait. Ignored on GPUs.
    first_token_yield_ms: float = 4.0
    lease_ttl_ms: int = 30000  # default lifetime of a KV lease this worker grants
    kv_push_timeout_ms: int = 10000  # prefill: wait this long for a decode worker's ack
    # Prefill on CUDA: "auto" moves KV to a decode worker on this host GPU to GPU (CUDA IPC),
    # host staging over ZMQ where that is refused; "host": host staging always.
    kv_transfer: str = "auto"
    # Mutual TLS on internal gRPC, CURVE on ZMQ, with the credentials in this directory
    # (shared/wire/tls.py; `llmfleet tls init DIR`); None: plaintext.
    tls_dir: str | None = None
    # For tests only: every engine step from this one on (1-based) fails as a failing forward
    # pass would (the worker hands its requests back, turns NOT_SERVING, exits non-zero); 0: off.
    fault_inject_step: int = 0

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValidationError("role", f"must be one of {', '.join(WORKER_ROLES)}")
        if (self.kvstore_address is None) != (self.kvstore_endpoint is None):
            raise ValidationError(
                "kvstore_endpoint", "kvstore_address and kvstore_endpoint go together"
            )
        if self.kvstore_events_endpoint is not None and self.kvstore_address is None:
            raise ValidationError(
                "kvstore_events_endpoint", "needs kvstore_address and kvstore_endpoint"
            )
        if self.kvstore_put_delay_ms < 0:
            raise ValidationError("kvstore_put_delay_ms", "must be >= 0")
        if self.kvstore_put_max_bytes < 0:
            raise ValidationError("kvstore_put_max_bytes", "must be >= 0")
        if not 0 <= self.first_token_yield_ms <= 1000:
            raise ValidationError("first_token_yield_ms", "must be in [0, 1000]")
        _check_lease_ttl(self.lease_ttl_ms)
        if self.fault_inject_step < 0:
            raise ValidationError("fault_inject_step", "must be >= 0 (0: off)")
        if self.kv_transfer not in ("auto", "host"):
            raise ValidationError("kv_transfer", f"must be auto or host, got {self.kv_transfer}")


@dataclass(frozen=True)
class KVStoreConfig:
    ENV_SECTION: typing.ClassVar[str] = "KVSTORE"
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    data_port: int = 0  # ZMQ ROUTER for put/get
    events_port: int = 0  # ZMQ PUB for stored/evicted events
    ram_bytes: int = 1 << 30
    disk_dir: str | None = None  # None: RAM tier only
    disk_bytes: int = 8 << 30
    # Mutual TLS on internal gRPC, CURVE on ZMQ, with the credentials in this directory
    # (shared/wire/tls.py; `llmfleet tls init DIR`); None: plaintext.
    tls_dir: str | None = None

    def __post_init__(self) -> None:
        if self.ram_bytes < 1:
            raise ValidationError("ram_bytes", "must be >= 1")


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI-compatible HTTP gateway in front of the router's public gRPC API."""

    ENV_SECTION: typing.ClassVar[str] = "GATEWAY"
    host: str = "127.0.0.1"
    port: int = 8000  # HTTP port of /v1/*, /health and /metrics; 0: any free port
    metrics_port: int | None = None  # /metrics on a port of its own too (0: any); None: no
    router_address: str = "127.0.0.1:50051"
    # The model name clients send and /v1/models lists; None: the router's model id.
    served_model_name: str | None = None
    # The tokenizer (HF directory or .gguf; None: the bundled SmolLM2) of the served model: it
    # spells logprob tokens and counts chat prompts for the default max_tokens.
    model: str | None = None
    request_timeout_s: float | None = None  # per generation request; None: no limit
    # A request body larger than this is answered 413 without being read (body_limit.py).
    max_request_bytes: int = 16 * 1024 * 1024
    grace_s: float = 30.0  # on SIGTERM: finish open requests for this long, then close
    # The Responses API's store of answered responses (responses_store.py): kept for GET and
    # `previous_response_id` until one of these bounds evicts them (entries 0: none kept).
    responses_store_max_entries: int = 10_000
    responses_store_max_bytes: int = 256 * 1024 * 1024
    responses_store_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValidationError("port", f"must be in [0, 65535], got {self.port}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValidationError("request_timeout_s", "must be > 0")
        if self.max_request_bytes < 1:
            raise ValidationError("max_request_bytes", "must be >= 1")
        if self.grace_s < 0:
            raise ValidationError("grace_s", "must be >= 0")
        if self.served_model_name == "":
            raise ValidationError("served_model_name", "must not be empty")
        if self.responses_store_max_entries < 0:
            raise ValidationError("responses_store_max_entries", "must be >= 0")
        if self.responses_store_max_bytes < 0:
            raise ValidationError("responses_store_max_bytes", "must be >= 0")
        if self.responses_store_ttl_s <= 0:
            raise ValidationError("responses_store_ttl_s", "must be > 0")


@dataclass(frozen=True)
class AuthConfig:
    """API keys of the public doors (gateway HTTP, router `Generation`): `LLMFLEET_API_KEYS`
    (comma-separated) or repeated `--api-key`; entries `TENANT:SECRET` or `SECRET`
    (shared/core/api_keys.py). Empty: auth off."""

    api_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", tuple(self.api_keys))  # a flag's list
        KeyRing.parse(self.api_keys)  # raises ValidationError("api_keys") naming no secret

    def __repr__(self) -> str:  # never print the keys
        return f"AuthConfig(api_keys=<{len(self.api_keys)} keys>)"

    @property
    def keyring(self) -> KeyRing:
        return KeyRing.parse(self.api_keys)


def _check_lease_ttl(ttl_ms: int) -> None:
    if not 1 <= ttl_ms <= MAX_LEASE_TTL_MS:
        raise ValidationError("lease_ttl_ms", f"must be in [1, {MAX_LEASE_TTL_MS}], got {ttl_ms}")


def from_env(cls: type[T], env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build config `cls` from `LLMFLEET_*` variables, then `overrides` (None values ignored)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    section = getattr(cls, "ENV_SECTION", "")
    prefix = ENV_PREFIX + (section + "_" if section else "")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        key = prefix + f.name.upper()
        if key in env:
            values[f.name] = _parse(f.name, env[key], hints[f.name])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def _parse(name: str, raw: str, hint: Any) -> Any:
    if typing.get_origin(hint) is tuple:  # comma-separated
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if optional and raw.strip().lower() in ("", "none"):
        return None
    try:
        if base is bool:
            if raw.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if raw.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if base is int:
            return int(raw, 0)
        if base is float:
            return float(raw)
        if base is str or isinstance(base, types.UnionType):
            return raw
    except ValueError:
        raise ValidationError(name, f"cannot parse {raw!r} as {base.__name__}") from None
    return raw
