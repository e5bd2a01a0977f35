"""API keys at the public doors (gateway HTTP, router `Generation`) and the tenant they name.

A configured key entry is `TENANT:SECRET` or a bare `SECRET`; the caller sends only the SECRET
(`Authorization: Bearer SECRET`). A bare secret's tenant is `key-` + the first 12 hex digits of
its SHA-256, so it is stable across restarts and never reveals the secret. Several entries may
name one tenant (key rotation): they share that tenant's prefix cache.

    ring = KeyRing.parse(("alice:sk-a", "sk-b"))
    ring.tenant_of("sk-a")            # "alice"; None for an unknown secret
    tenant_salt("alice", "")          # the cache salt of alice's requests

The prefix-cache salt of an authenticated request is `tenant_salt(tenant, client_salt)`: a
fixed-length digest of the tenant, then the client's own salt, so two tenants never hash a
block alike while one tenant's requests (with equal client salts) still do. Secrets are never
put in messages or logs; comparisons are constant-time over every configured key.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmfleet.shared.core.errors import ValidationError

BEARER = "bearer "


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    tenant: str
    secret: str = field(repr=False)  # never printed


@dataclass(frozen=True)
class KeyRing:
    """The configured keys; empty means auth is off."""

    keys: tuple[ApiKey, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> KeyRing:
        """Keys from `TENANT:SECRET` / `SECRET` entries; raises ValidationError("api_keys")."""
        keys: list[ApiKey] = []
        for i, raw in enumerate(entries):
            entry = raw.strip()
            tenant, sep, secret = entry.partition(":")
            if not sep:
                tenant, secret = "key-" + _digest(entry)[:12], entry
            if not secret or not tenant:
                raise ValidationError(
                    "api_keys", f"entry {i} must be TENANT:SECRET or SECRET, both non-empty"
                )
            if any(c.isspace() or c == "," for c in secret):
                raise ValidationError("api_keys", f"entry {i}: a secret has no spaces or commas")
            if any(hmac.compare_digest(k.secret, secret) for k in keys):
                raise ValidationError("api_keys", f"entry {i} repeats an earlier secret")
            keys.append(ApiKey(tenant, secret))
        return cls(tuple(keys))

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def tenant_of(self, secret: str | None) -> str | None:
        """The tenant whose key is `secret`, else None. Every key is compared (in constant time
        each), so the time taken does not tell which key, if any, matched."""
        if not secret:
            return None
        found = None
        presented = secret.encode()
        for key in self.keys:
            if hmac.compare_digest(key.secret.encode(), presented):
                found = key.tenant
        return found

    def any_secret(self) -> str | None:
        """A configured secret, for a service's own calls behind this door (None: auth off)."""
        return self.keys[0].secret if self.keys else None


def bearer_secret(authorization: str | None) -> str | None:
    """SECRET of an `Authorization: Bearer SECRET` value (scheme case-insensitive), else None."""
    if not authorization or authorization[: len(BEARER)].lower() != BEARER:
        return None
    return authorization[len(BEARER) :].strip() or None


def tenant_salt(tenant: str, client_salt: str) -> str:
    """The prefix-cache salt of a tenant's request: the tenant's digest, then its own salt."""
    return f"tenant:{_digest(tenant)[:32]}/{client_salt}"


def add_api_key_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--api-key [TENANT:]SECRET` (repeatable, into `api_keys`), for the services that take
    keys and for `llmfleet up`."""
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        metavar="[TENANT:]SECRET",
        help=help
        or "an API key callers must send (repeatable; default: $LLMFLEET_API_KEYS; none: open)",
    )
