"""Reaching a Dask cluster of the user's (``runtime.executor: cluster``): who may talk to it.

A Dask scheduler runs whatever a client sends it, on every worker. On ``tls://`` the
scheduler, its workers and this process authenticate each other with certificates one
CA signed (mutual TLS, Dask's ``Security``), so reaching the port is not enough. The
certificates come from ``runtime.tls`` or, where that is not set, from Dask's own
configuration (``distributed.comm.tls.*``, e.g. in ``~/.config/dask/distributed.yaml``).
Plain ``tcp://`` to another machine is refused when the config is read, unless
``runtime.trusted_network`` says the network is the user's alone
(bhfl_core/config/schema.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import RuntimeConfig

CONNECT_TIMEOUT = "60s"  # Dask retries a refused or failed connection until then


def security_for(address: str, runtime: RuntimeConfig) -> Any:
    """Dask's ``Security`` for ``address``: None unless it is ``tls://``; from ``runtime.tls``, else Dask's config.

    A missing or unreadable file is a ``ConfigError`` naming its key; so is a ``tls://``
    address with no certificate anywhere.
    """
    if not address.startswith("tls://"):
        return None
    from distributed.security import Security

    if runtime.tls is None:
        security = Security(require_encryption=True)  # distributed.comm.tls.{ca-file,client.cert,client.key}
        if not (getattr(security, "tls_ca_file", None) and getattr(security, "tls_client_cert", None)):
            raise ConfigError(
                f"runtime.cluster is {address} but no certificate is set: give runtime.tls "
                "({ca_file, cert_file, key_file}: the CA that signed the cluster's certificates, this machine's "
                "certificate and key) or Dask's distributed.comm.tls.ca-file and distributed.comm.tls.client.cert/"
                'key (docs/runtime.md, "A cluster over TLS")'
            )
        return security
    files = {"ca_file": runtime.tls.ca_file, "cert_file": runtime.tls.cert_file, "key_file": runtime.tls.key_file}
    for key, path in files.items():
        if not os.access(path, os.R_OK) or not Path(path).is_file():
            raise ConfigError(f"runtime.tls.{key}: {path} is not a file this process can read")
    return Security(
        tls_ca_file=files["ca_file"],
        tls_client_cert=files["cert_file"],
        tls_client_key=files["key_file"],
        require_encryption=True,
    )


@contextmanager
def connected(address: str, runtime: RuntimeConfig) -> Iterator[Any]:
    """A Dask client of the cluster at ``address``; one that cannot connect is a ``ConfigError`` saying why.

    Used where a run starts, so a wrong address or certificate stops it before any work
    (a TLS handshake that fails is retried by Dask until ``CONNECT_TIMEOUT``).
    """
    from distributed import Client

    security = security_for(address, runtime)
    try:
        client = Client(address, security=security, set_as_default=False, timeout=CONNECT_TIMEOUT)
    except (OSError, TimeoutError) as exc:
        tls = (
            " The scheduler must trust the CA of runtime.tls.ca_file (its --tls-ca-file) and hold a certificate "
            "that CA signed; a tcp:// client cannot reach a tls:// scheduler, nor the reverse."
            if security is not None or address.startswith("tcp://")
            else ""
        )
        raise ConfigError(
            f"runtime.cluster: cannot connect to the Dask scheduler at {address} ({exc}). Is `dask scheduler` "
            f"running there, and reachable from this machine?{tls}"
        ) from None
    try:
        yield client
    finally:
        client.close()
