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
from llmfleet.shared.core.errors import ValidationError

ENV_PREFIX = "LLMFLEET_"
T = TypeVar("T")

# Messages between services may be this large (shared/wire/limits.py); a public port's limit
# may not exceed it, so what a public port accepts never fails an internal hop for its size.
INTERNAL_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The longest a KV lease may live (a worker refuses a ReserveKV asking for more).
MAX_LEASE_TTL_MS = 10 * 60 * 1000


@dataclass(frozen=True)
class EngineConfig:
    """The engine core of one worker (any role)."""

    model: str | None = None  # HF checkpoint dir or .gguf file; None: the bundled SmolLM2
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16
    block_size: int = 16
    # KV cache size: an explicit block count wins; otherwise `kv_cache_bytes` is divided by the
    # model's bytes per block. Unset on a CUDA device: what `gpu_memory_utilization` of the GPU
    # leaves after the weights and a step's activations (engine/memory.py); elsewhere 1 GiB.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # The share of the GPU's memory this worker may use in all; two workers on one GPU split it.
    gpu_memory_utilization: float = 0.9
    # Sequences and tokens per step; unset: 256 and 8192 on a CUDA device, 64 and 2048 elsewhere.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    max_n: int = 16
    max_logprobs: int = 20
    # Intra-op CPU threads; None: torch's default on a CPU device, 1 with a CUDA device.
    num_threads: int | None = None
    # CUDA devices: decode steps of up to this many sequences replay CUDA graphs captured at
    # start-up (capped by max_num_seqs); 0 runs every step eagerly; unset: max_num_seqs, at
    # most 512. Ignored on the CPU.
    cuda_graph_max_batch_size: int | None = None
    # With CUDA graphs: launch the next decode step from the current one's token ids on the
    # device, before reading them back, so the host's work hides under the GPU's
    # (engine/async_scheduling.py).
    async_scheduling: bool = True
    # Online weight quantization at load: None (serve the checkpoint's weights in `dtype`) or
    # "fp8" (decoder projections as FP8 e4m3 W8A8; CUDA sm_89+, dtype bfloat16/float16).
    quantization: str | None = None
    # A simulated model (models/simulated.py): the checkpoint's tokenizer and KV geometry, no
    # weights, and a forward pass that takes sim_step_ms + sim_decode_ms_per_seq per decoding
    # sequence + sim_prefill_ms_per_token per prompt token (defaults: an 8B model on one
    # H100-class GPU), for benchmarking and testing the fleet on CPUs.
    simulate: bool = False
    sim_step_ms: float = 5.5
    sim_decode_ms_per_seq: float = 0.055
    sim_prefill_ms_per_token: float = 0.04

    def __post_init__(self) -> None:
        for name in ("sim_step_ms", "sim_decode_ms_per_seq", "sim_prefill_ms_per_token"):
            if not 0 <= getattr(self, name) <= 60_000:
                raise ValidationError(name, f"must be in [0, 60000], got {getattr(self, name)}")
        if self.simulate and self.quantization is not None:
            raise ValidationError("quantization", "a simulated model has no weights to quantize")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValidationError(
                "dtype", f"must be float32, bfloat16 or float16, got {self.dtype}"
            )
        if self.quantization not in (None, "fp8"):
            raise ValidationError("quantization", f"must be fp8 or unset, got {self.quantization}")
        if self.quantization == "fp8" and (
            self.dtype == "float32" or not self.device.startswith("cuda")
        ):
            raise ValidationError(
                "quantization",
                f"fp8 needs device cuda and dtype bfloat16 or float16 "
                f"(got device {self.device}, dtype {self.dtype})",
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValidationError("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValidationError("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValidationError("kv_cache_bytes", "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValidationError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValidationError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        batched = self.max_num_batched_tokens
        if batched is not None and batched < self.block_size:
            raise ValidationError(
                "max_num_batched_tokens",
                f"must be >= block_size ({self.block_size}), got {batched}",
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValidationError("max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.max_n < 1 or self.max_logprobs < 0:
            raise ValidationError("max_n", "max_n must be >= 1 and max_logprobs >= 0")
        if self.cuda_graph_max_batch_size is not None and self.cuda_graph_max_batch_size < 0:
            raise ValidationError(
                "cuda_graph_max_batch_size",
                f"must be >= 0 (0 disables CUDA graphs), got {self.cuda_graph_max_batch_size}",
            )

    def resolved(self) -> EngineConfig:
        """This config with its device's defaults for the sizes left unset (`kv_cache_bytes`
        stays: the engine sizes it once the weights are loaded)."""
        gpu = self.device.startswith("cuda") and not self.simulate
        seqs = self.max_num_seqs or (256 if gpu else 64)
        graphs = self.cuda_graph_max_batch_size
        return dataclasses.replace(
            self,
            max_num_seqs=seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or (8192 if gpu else 2048),
            cuda_graph_max_batch_size=min(seqs, 512) if graphs is None else graphs,
        )

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.dtype)


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
    # Mutual TLS on internal gRPC, CURVE on ZMQ, with the credentials in this directory
    # (shared/wire/tls.py; `llmfleet tls init DIR`); None: plaintext.
    tls_dir: str | None = None

    def __post_init__(self) -> None:
        if self.grace_s < 0:
            raise ValidationError("grace_s", "must be >= 0")
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
