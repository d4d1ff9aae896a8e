"""The certificates of a ``tls://`` cluster are checked before a run starts, each mistake naming its key.

Real files: a CA and a certificate made with ``cryptography`` (tests/flows/tls_certs.py),
and the kinds of wrong file a user hands over (missing, not PEM, a certificate and its
key swapped, the key of another certificate, an encrypted key), given both ways
docs/runtime.md shows: ``runtime.tls`` and Dask's own ``distributed.comm.tls.*``
settings. Before, the Dask-config way was not checked at all (a missing file surfaced
after the run had started, as "cannot connect ... [Errno 2] No such file or
directory"), and a file that was readable but not a certificate or key, in either
way, as "[SSL] PEM lib" after the connection attempt, naming no file.
"""

from pathlib import Path

import dask
import pytest
from cryptography.hazmat.primitives import serialization

from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import RuntimeConfig
from tasks.cluster_access import security_for
from tests.flows.tls_certs import make_certificates

ADDRESS = "tls://127.0.0.1:8786"
UNREADABLE = "is not a file this process can read"
NO_CERTIFICATE = "holds no PEM certificate"


def _runtime(ca: Path, cert: Path, key: Path) -> RuntimeConfig:
    tls = {"ca_file": str(ca), "cert_file": str(cert), "key_file": str(key)}
    return RuntimeConfig(executor="cluster", cluster=ADDRESS, tls=tls)


def _dask_config(ca: Path, cert: Path, key: Path) -> dict[str, str]:
    return {
        "distributed.comm.tls.ca-file": str(ca),
        "distributed.comm.tls.client.cert": str(cert),
        "distributed.comm.tls.client.key": str(key),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    certs = make_certificates(folder / "ours")
    other = make_certificates(folder / "other", ca_name="another CA")
    garbage = folder / "garbage.pem"
    garbage.write_text("not a certificate\n")
    encrypted = folder / "encrypted.key"
    key = serialization.load_pem_private_key(certs.key_file.read_bytes(), password=None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pass phrase"),
        )
    )
    return {"ours": certs, "other": other, "garbage": garbage, "encrypted": encrypted, "missing": folder / "nope.key"}


def _cases(files) -> list[tuple[str, tuple[Path, Path, Path], str, str]]:
    """(case, (ca, cert, key), the key named, what is said of it)."""
    ours, other = files["ours"], files["other"]
    return [
        ("missing key", (ours.ca_file, ours.cert_file, files["missing"]), "key_file", UNREADABLE),
        ("missing CA", (files["missing"], ours.cert_file, ours.key_file), "ca_file", UNREADABLE),
        ("CA not PEM", (files["garbage"], ours.cert_file, ours.key_file), "ca_file", NO_CERTIFICATE),
        ("certificate not PEM", (ours.ca_file, files["garbage"], ours.key_file), "cert_file", NO_CERTIFICATE),
        ("swapped", (ours.ca_file, ours.key_file, ours.cert_file), "cert_file", NO_CERTIFICATE),
        ("key not PEM", (ours.ca_file, ours.cert_file, files["garbage"]), "key_file", "holds no PEM private key"),
        ("another's key", (ours.ca_file, ours.cert_file, other.key_file), "key_file", "not the key of the certificate"),
        (
            "encrypted key",
            (ours.ca_file, ours.cert_file, files["encrypted"]),
            "key_file",
            "the private key is encrypted",
        ),
    ]


DASK_KEY = {"ca_file": "ca-file", "cert_file": "client.cert", "key_file": "client.key"}


def test_each_wrong_file_is_named_by_its_key_in_runtime_tls_and_in_dasks_config(files):
    for case, (ca, cert, key), named, said in _cases(files):
        wrong = {"ca_file": ca, "cert_file": cert, "key_file": key}[named]
        with pytest.raises(ConfigError) as given:
            security_for(ADDRESS, _runtime(ca, cert, key))
        assert str(given.value).startswith(f"runtime.tls.{named}: {wrong}"), (case, str(given.value))
        assert said in str(given.value), (case, str(given.value))
        with dask.config.set(_dask_config(ca, cert, key)), pytest.raises(ConfigError) as configured:
            security_for(ADDRESS, RuntimeConfig(executor="cluster", cluster=ADDRESS))
        message = str(configured.value)
        assert message.startswith(f"distributed.comm.tls.{DASK_KEY[named]}: {wrong}"), (case, message)
        assert said in message and "Dask's configuration" in message, (case, message)


def test_good_files_give_dasks_security_either_way(files):
    ours = files["ours"]
    security = security_for(ADDRESS, _runtime(ours.ca_file, ours.cert_file, ours.key_file))
    assert security.tls_client_key == str(ours.key_file) and security.require_encryption
    assert security.get_connection_args("client")["require_encryption"]  # Dask builds its context from them
    with dask.config.set(_dask_config(ours.ca_file, ours.cert_file, ours.key_file)):
        security = security_for(ADDRESS, RuntimeConfig(executor="cluster", cluster=ADDRESS))
    assert security.tls_ca_file == str(ours.ca_file) and security.tls_client_cert == str(ours.cert_file)
    combined = ours.cert_file.parent / "combined.pem"  # Dask also takes the key inside the certificate's file
    combined.write_bytes(ours.cert_file.read_bytes() + ours.key_file.read_bytes())
    in_one = {"distributed.comm.tls.ca-file": str(ours.ca_file), "distributed.comm.tls.client.cert": str(combined)}
    with dask.config.set(in_one):
        assert security_for(ADDRESS, RuntimeConfig(executor="cluster", cluster=ADDRESS)) is not None
    plain = "tcp://127.0.0.1:8786"
    assert security_for(plain, RuntimeConfig(executor="cluster", cluster=plain)) is None
