"""Certificates for a Dask cluster over TLS, made in the test: a CA, and one certificate it signed.

What docs/runtime.md ("A cluster over TLS") makes with ``openssl``, made here with the
``cryptography`` package: EC P-256 keys (fast to generate), a CA certificate that may
sign, and a certificate for the scheduler, the workers and the client alike (Dask
checks the signature, not the host name), valid for TLS servers and clients.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TlsFiles:
    """A CA's certificate and a certificate + key it signed (PEM files)."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def dask_args(self) -> list[str]:
        """The flags of ``dask scheduler`` and ``dask worker`` that make them use these files."""
        return ["--tls-ca-file", str(self.ca_file), "--tls-cert", str(self.cert_file), "--tls-key", str(self.key_file)]

    def security(self) -> Any:
        from distributed.security import Security

        return Security(
            tls_ca_file=str(self.ca_file),
            tls_client_cert=str(self.cert_file),
            tls_client_key=str(self.key_file),
            require_encryption=True,
        )

    def config_value(self) -> str:
        """``runtime.tls`` as a ``--set`` value."""
        return f"runtime.tls={{ca_file: {self.ca_file}, cert_file: {self.cert_file}, key_file: {self.key_file}}}"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_certificates(folder: Path, ca_name: str = "bhfl test CA") -> TlsFiles:
    """A new CA named ``ca_name`` and a certificate it signed, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_name))
        .issuer_name(_name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # key_cert_sign, crl_sign
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("bhfl cluster"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.pem", folder / "cluster.pem", folder / "cluster.key")
    files.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key_file.write_bytes(_pem_key(key))
    files.key_file.chmod(0o600)
    return files
