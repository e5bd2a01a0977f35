"""The fleet's credentials for internal traffic: mutual TLS on gRPC, CURVE on ZMQ.

A TLS directory (`--tls-dir DIR`, made by `llmfleet tls init DIR`) holds:

    ca.crt                 the fleet CA's certificate (PEM): the only issuer peers accept
    fleet.crt, fleet.key   a certificate signed by it, and its key, which every service
                           presents as server and as client (SAN DNS:llmfleet-internal)
    curve/fleet.key        the fleet's CURVE public key (zmq.auth certificate format)
    curve/fleet.key_secret ... and its secret key
    ca.key                 the CA's key (`tls init` writes it to sign more; services never
                           read it: keep it off the machines that run them)

Internal gRPC servers require a client certificate from the fleet CA; internal clients present
theirs and check the server's against the CA under the fixed name `llmfleet-internal`
(`grpc.ssl_target_name_override`), so certificates do not depend on hostnames or addresses.

Every socket of a `CurveContext` speaks CURVE with the fleet's keypair; a socket that binds
(`transport.bind`) is the CURVE server, and the context's ZAP handler admits only clients whose
public key is in `curve/`. Without a TLS directory (`load(None)` is None) everything stays
plaintext: `insecure_channel`, `add_insecure_port`, a plain `zmq.asyncio.Context`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from llmfleet.shared.core.errors import ValidationError

SERVER_NAME = "llmfleet-internal"  # the name every fleet certificate carries and clients expect
CA_CERT, CERT, KEY, CA_KEY = "ca.crt", "fleet.crt", "fleet.key", "ca.key"
CURVE_DIR, CURVE_NAME = "curve", "fleet"

TLS_DIR_HELP = "fleet credentials (llmfleet tls init DIR): mutual TLS and CURVE on internal ports"
ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class FleetTLS:
    """One service's credentials, read from a TLS directory."""

    tls_dir: Path
    ca: bytes
    cert: bytes
    key: bytes
    curve_public: bytes  # z85
    curve_secret: bytes  # z85

    @property
    def curve_dir(self) -> Path:
        return self.tls_dir / CURVE_DIR

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def load(tls_dir: str | Path | None) -> FleetTLS | None:
    """The credentials in `tls_dir` (None: none, plaintext). A missing or unreadable file is a
    ValidationError naming `tls_dir`."""
    if tls_dir is None:
        return None
    d = Path(tls_dir)
    try:
        ca, cert, key = ((d / name).read_bytes() for name in (CA_CERT, CERT, KEY))
        public, secret = zmq.auth.load_certificate(d / CURVE_DIR / f"{CURVE_NAME}.key_secret")
    except (OSError, ValueError) as exc:
        raise ValidationError(
            "tls_dir", f"{d}: {exc} (make one with `llmfleet tls init DIR`)"
        ) from None
    if secret is None:
        raise ValidationError("tls_dir", f"{d / CURVE_DIR}: no CURVE secret key")
    return FleetTLS(d, ca, cert, key, public, secret)


# ---- gRPC ------------------------------------------------------------------------------------


def _options(tls: FleetTLS | None, options: ChannelOptions) -> list[tuple[str, Any]]:
    extra = [("grpc.ssl_target_name_override", SERVER_NAME)] if tls is not None else []
    return [*options, *extra]


def aio_channel(
    address: str, tls: FleetTLS | None, options: ChannelOptions = ()
) -> grpc.aio.Channel:
    """An asyncio channel to an internal service: mutual TLS with `tls`, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), _options(tls, options))


def channel(address: str, tls: FleetTLS | None, options: ChannelOptions = ()) -> grpc.Channel:
    """A blocking channel to an internal service (the launcher's health checks)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), _options(tls, options))


def add_port(server: grpc.aio.Server, address: str, tls: FleetTLS | None) -> int:
    """Listen on `address`: requiring the fleet's client certificates with `tls`; 0 on failure."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


# ---- ZMQ -------------------------------------------------------------------------------------


class CurveContext(zmq.asyncio.Context):
    """A context whose sockets all speak CURVE with the fleet's keypair (as clients of a peer
    holding the same keypair); `serve(sock)` before binding makes one the server."""

    _tls: FleetTLS | None = None
    _auth: ThreadAuthenticator | None = None

    def __init__(self, tls: FleetTLS) -> None:
        super().__init__()
        self._tls = tls
        self.setsockopt(zmq.CURVE_PUBLICKEY, tls.curve_public)
        self.setsockopt(zmq.CURVE_SECRETKEY, tls.curve_secret)
        self.setsockopt(zmq.CURVE_SERVERKEY, tls.curve_public)  # every peer: the fleet's key

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server admitting only the fleet's keys (call before bind)."""
        if self._auth is None and self._tls is not None:
            # ZAP is per libzmq context: the handler thread uses a blocking shadow of this one.
            auth = ThreadAuthenticator(zmq.Context(shadow=self.underlying))
            auth.start()
            auth.configure_curve(domain="*", location=str(self._tls.curve_dir))
            self._auth = auth
        sock.curve_server = True

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def term(self) -> None:
        self._stop_auth()
        super().term()

    def destroy(self, linger: int | None = None) -> None:
        self._stop_auth()
        super().destroy(linger)


def blocking_shadow(ctx: zmq.Context) -> zmq.Context:
    """A blocking context over the same libzmq context with the same default socket options
    (a `CurveContext`'s keys: its sockets speak CURVE too)."""
    shadow = zmq.Context.shadow(ctx.underlying)
    for opt, value in ctx.sockopts.items():
        shadow.setsockopt(opt, value)
    return shadow


def zmq_context(tls: FleetTLS | None) -> zmq.asyncio.Context:
    """A context for the data plane: CURVE with `tls`, else plaintext."""
    return zmq.asyncio.Context() if tls is None else CurveContext(tls)
