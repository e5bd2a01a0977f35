"""Internal traffic under mutual TLS and CURVE (`--tls-dir`), internal ports apart from public.

A disaggregated fleet of simulated workers with a kvstore and a TLS dir from `llmfleet tls
init` serves requests end to end: token batches, KV pushes prefill -> decode, kvstore puts and
KV events all cross CURVE sockets, every internal RPC mutual TLS. A caller without the fleet's
credentials gets nothing through: a plaintext gRPC client, a client with a certificate of
another CA, a ZMQ peer without the fleet's CURVE keypair. The public Generation port stays
plaintext, and only it (and no internal port) binds on the public `--host`.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from zmq.utils.monitor import recv_monitor_message

from llmfleet.cli.fleet_plan import FleetSpec
from llmfleet.cli.launcher import Fleet
from llmfleet.cli.main import main as llmfleet_main
from llmfleet.client.generation import GenerationClient
from llmfleet.services.worker.kvstore_client import KVStoreClient
from llmfleet.shared.core.config import RouterConfig
from llmfleet.shared.core.errors import LLMFleetError, ValidationError
from llmfleet.shared.wire import tls
from llmfleet.v1 import kvstore_pb2, kvstore_pb2_grpc, worker_pb2, worker_pb2_grpc

SIMULATED = {"simulate": True, "sim_step_ms": 1.0, "sim_decode_ms_per_seq": 0.01}
PROMPT = [100 + i % 50 for i in range(80)]  # > short_prompt_threshold: prefilled remotely
MAX_TOKENS = 8
LAYOUT = "m|L1|B16|H1|D8|float32"
PUBLIC_HOST = "127.0.0.2"  # loopback too, but not the internal 127.0.0.1


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    """The fleet's TLS dir and another one (another CA, another CURVE keypair)."""
    fleet_dir, other_dir = tmp_path_factory.mktemp("tls"), tmp_path_factory.mktemp("other")
    for d in (fleet_dir, other_dir):
        assert llmfleet_main(["tls", "init", str(d / "creds")]) == 0
    return tls.load(fleet_dir / "creds"), tls.load(other_dir / "creds")


@pytest.fixture(scope="module")
def fleet(creds, tmp_path_factory):
    spec = FleetSpec(
        host=PUBLIC_HOST,
        port=0,
        disaggregated=True,
        engine=SIMULATED,
        kvstore=True,
        tls_dir=str(creds[0].tls_dir),
        log_dir=str(tmp_path_factory.mktemp("logs")),
        startup_timeout_s=120,
        extra_args={"worker": ["--num-kv-blocks", "256", "--block-size", "16"]},
    )
    with Fleet(spec) as f:
        yield f


def _generate(fleet: Fleet) -> list[int]:
    with GenerationClient(fleet.endpoint) as client:
        result = client.generate(token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    return result.completions[0].token_ids


def _metric(url: str, name: str, labels: dict[str, str]) -> float:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name}{labels} not in {url}")


def _health(channel: grpc.Channel) -> grpc.StatusCode | int:
    """The health status the server answers, or the status code of the failed call."""
    try:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(), timeout=3)
            .status
        )
    except grpc.RpcError as exc:
        return exc.code()


def _internal_addresses(fleet: Fleet) -> dict[str, str]:
    return {
        "worker": fleet.child("decode-0").address,
        "kvstore": fleet.kvstore_address,
        "tokenizer": fleet.tokenizer_address,
        "registry": fleet.registry_address,
    }


def test_fleet_with_tls_dir_serves_end_to_end(fleet, creds):
    assert len(_generate(fleet)) == MAX_TOKENS
    assert len(_generate(fleet)) == MAX_TOKENS  # the prompt again: prefix from cache or store
    decode = fleet.child("decode-0")
    # The prefill worker pushed the prompt's KV over CURVE; the decode worker took it.
    received = "llmfleet:kv_transfer_bytes_total"
    assert _metric(decode.metrics_url, received, {"direction": "receive"}) > 0
    # Puts (over the CURVE data port) and their KV events (CURVE PUB/SUB) follow the first
    # token in the background: wait for them.
    deadline = time.monotonic() + 20
    while True:
        with tls.channel(fleet.kvstore_address, creds[0]) as ch:
            store = kvstore_pb2_grpc.KVStoreStub(ch).GetStoreStats(
                kvstore_pb2.GetStoreStatsRequest(), timeout=5
            )
        with tls.channel(fleet.child("prefill-0").address, creds[0]) as ch:
            worker = worker_pb2_grpc.WorkerStub(ch).GetWorkerStats(
                worker_pb2.GetWorkerStatsRequest(), timeout=5
            )
        stored = (store.puts, worker.kvstore_blocks_stored, worker.kvstore_view_blocks)
        if min(stored) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert min(stored) > 0, stored


def test_internal_grpc_ports_refuse_callers_without_the_fleets_certificate(fleet, creds):
    fleet_tls, other = creds
    for name, address in _internal_addresses(fleet).items():
        with tls.channel(address, fleet_tls) as ch:
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING, name
        with grpc.insecure_channel(address) as ch:
            assert _health(ch) == grpc.StatusCode.UNAVAILABLE, name
        with tls.channel(address, other) as ch:  # another CA: neither side trusts the other
            assert _health(ch) == grpc.StatusCode.UNAVAILABLE, name
        # The fleet's CA trusted, but a client certificate of another CA: the server refuses.
        foreign = grpc.ssl_channel_credentials(fleet_tls.ca, other.key, other.cert)
        options = [("grpc.ssl_target_name_override", tls.SERVER_NAME)]
        with grpc.secure_channel(address, foreign, options) as ch:
            assert _health(ch) == grpc.StatusCode.UNAVAILABLE, name


def test_public_port_stays_plaintext_and_alone_on_the_public_host(fleet, creds):
    assert fleet.endpoint.startswith(f"{PUBLIC_HOST}:")
    with grpc.insecure_channel(fleet.endpoint) as ch:
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
    for name, address in _internal_addresses(fleet).items():
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1", name
        with tls.channel(f"{PUBLIC_HOST}:{port}", creds[0]) as ch:  # nothing listens there
            assert _health(ch) == grpc.StatusCode.UNAVAILABLE, name


def _handshake_events(ctx: zmq.Context, endpoint: str, configure) -> set[int]:
    """Connect a PUSH configured by `configure` to `endpoint`; the handshake events seen."""
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    configure(sock)
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    wanted = {
        zmq.EVENT_HANDSHAKE_SUCCEEDED,
        zmq.EVENT_HANDSHAKE_FAILED_AUTH,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    }
    seen: set[int] = set()
    try:
        while not seen & wanted and monitor.poll(5000):
            event = recv_monitor_message(monitor)
            seen.add(event["event"])
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
    return seen


def test_zmq_ports_refuse_peers_without_the_fleets_curve_keys(fleet, creds):
    fleet_tls, other = creds
    replies = fleet.child("router").log_path.read_text().split("replies on ")[1].split()[0]
    ctx = zmq.Context()

    def keyed(pair: tls.FleetTLS):
        def configure(sock: zmq.Socket) -> None:
            sock.curve_publickey, sock.curve_secretkey = pair.curve_public, pair.curve_secret
            sock.curve_serverkey = fleet_tls.curve_public  # the server's key is no secret

        return configure

    try:
        ok = _handshake_events(ctx, replies, keyed(fleet_tls))
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED in ok
        denied = _handshake_events(ctx, replies, keyed(other))
        assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in denied  # ZAP: not the fleet's key
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in denied
        plain = _handshake_events(ctx, replies, lambda sock: None)
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in plain
    finally:
        ctx.term()
    assert len(_generate(fleet)) == MAX_TOKENS  # the fleet serves on


def test_kvstore_data_port_answers_only_the_fleet(fleet, creds):
    fleet_tls, other = creds
    data = fleet.child("kvstore").argv
    endpoint = f"tcp://{fleet.spec.internal_host}:{data[data.index('--data-port') + 1]}"
    hashes = [bytes(32)]

    async def get(pair: tls.FleetTLS | None) -> list[memoryview]:
        ctx = tls.zmq_context(pair)
        if pair is not None:  # the server's public key is known; the client's is not the fleet's
            ctx.setsockopt(zmq.CURVE_SERVERKEY, fleet_tls.curve_public)
        client = KVStoreClient(fleet.kvstore_address, endpoint, ctx=ctx, timeout_s=2.0)
        try:
            return await client.get(LAYOUT, hashes)
        finally:
            await client.close()
            ctx.destroy(linger=0)

    assert asyncio.run(get(fleet_tls)) == []  # an answer: the store holds no such block
    for pair in (other, None):
        with pytest.raises(LLMFleetError, match="no reply"):
            asyncio.run(get(pair))
    assert len(_generate(fleet)) == MAX_TOKENS


def test_tls_init_never_overwrites_and_bad_tls_dirs_are_named(creds, tmp_path, capsys):
    existing = str(creds[0].tls_dir)
    assert llmfleet_main(["tls", "init", existing]) == 2
    assert "invalid tls_dir" in capsys.readouterr().err
    missing = str(tmp_path / "missing")
    assert llmfleet_main(["up", "--tls-dir", missing, "--port", "0", "--http-port", "0"]) == 2
    assert f"invalid tls_dir: {missing}" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="internal port"):
        RouterConfig(tls_dir=existing)  # the public port would carry the Registry in plaintext
