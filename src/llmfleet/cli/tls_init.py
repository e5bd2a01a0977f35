"""`llmfleet tls init DIR`: a development fleet CA, one fleet certificate signed by it and a
CURVE keypair, in the layout `--tls-dir` reads (shared/wire/tls.py).

The CA and the certificate use ECDSA P-256 keys. The certificate names `llmfleet-internal`
(the name internal clients expect), serves as server and as client (mutual TLS), and is valid
for `days`. Keys are written readable by their owner only. An existing file is never
overwritten.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import zmq.auth
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.wire.tls import CA_CERT, CA_KEY, CERT, CURVE_DIR, CURVE_NAME, KEY, SERVER_NAME


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, *, secret: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def init_tls_dir(tls_dir: str | Path, *, days: int = 365) -> list[Path]:
    """Write a fresh CA, fleet certificate and CURVE keypair into `tls_dir`; returns the files.
    Raises ValidationError (field `tls_dir`) when it already holds any of them."""
    if days < 1:
        raise ValidationError("days", f"must be >= 1, got {days}")
    d = Path(tls_dir)
    files = [d / n for n in (CA_CERT, CA_KEY, CERT, KEY)]
    curve = d / CURVE_DIR
    existing = [p for p in [*files, curve] if p.exists()]
    if existing:
        raise ValidationError("tls_dir", f"{existing[0]} exists; choose an empty directory")
    d.mkdir(parents=True, exist_ok=True)

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("llmfleet fleet CA"))
        .issuer_name(_name("llmfleet fleet CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(SERVER_NAME))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write(d / CA_CERT, ca.public_bytes(pem))
    _write(d / CA_KEY, _pem_key(ca_key), secret=True)
    _write(d / CERT, cert.public_bytes(pem))
    _write(d / KEY, _pem_key(key), secret=True)
    curve.mkdir(mode=0o700)
    public, secret = zmq.auth.create_certificates(curve, CURVE_NAME)
    os.chmod(secret, 0o600)
    return [*files, Path(public), Path(secret)]


def cmd_tls(args: argparse.Namespace) -> int:
    """`llmfleet tls init DIR [--days N]`: print the files written, one a line, on stdout."""
    for path in init_tls_dir(args.dir, days=args.days):
        print(path)
    return 0
