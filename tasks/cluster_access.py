"""Reaching a Dask cluster of the user's (``runtime.executor: cluster``), and checking it can serve a run.

Two things a cluster elsewhere needs that a local one does not:

- **Who may talk to it.** A Dask scheduler runs whatever a client sends it, on every
  worker. On ``tls://`` the scheduler, its workers and this process authenticate each
  other with certificates one CA signed (mutual TLS, Dask's ``Security``), so reaching
  the port is not enough. The certificates come from ``runtime.tls`` or, where that is
  not set, from Dask's own configuration (``distributed.comm.tls.*``, e.g. in
  ``~/.config/dask/distributed.yaml``). Plain ``tcp://`` to another machine is refused
  when the config is read, unless ``runtime.trusted_network`` says the network is the
  user's alone (bhfl_core/config/schema.py).
- **The same files.** Workers read the prepared data and the parent's model from the
  run folder and write their clients' checkpoints into it, so each must see the run
  folder and the data cache at the paths this process sees. ``check_shared_folders``
  has every worker read a file this process wrote there and write one back, before
  anything is trained: a worker that sees another folder (a local disk where the
  shared one should be mounted), none, or cannot write is named, with the fix, instead
  of failing later with a file error in the middle of a round.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bhfl_core.config.base import ConfigError
from bhfl_core.config.schema import RuntimeConfig
from data_prep.manifest import MANIFEST_NAME

CONNECT_TIMEOUT = "60s"  # Dask retries a refused or failed connection until then
PROBE_PREFIX = ".shared-folder-probe-"  # a hidden folder in the run folder, removed after the check
ORCHESTRATOR_FILE = "orchestrator"  # written by this process; every worker must read it


class SharedFolderError(RuntimeError):
    """Workers of the cluster that do not see the run folder or the data cache as this process does."""


DASK_TLS_KEYS = {  # where Dask's own configuration keeps what runtime.tls holds
    "ca_file": "distributed.comm.tls.ca-file",
    "cert_file": "distributed.comm.tls.client.cert",
    "key_file": "distributed.comm.tls.client.key",
}


def security_for(address: str, runtime: RuntimeConfig) -> Any:
    """Dask's ``Security`` for ``address``: None unless it is ``tls://``; from ``runtime.tls``, else Dask's config.

    A missing or unreadable file, or one that holds no certificate (no usable key), is a
    ``ConfigError`` naming its key (``runtime.tls.*``, or Dask's ``distributed.comm.tls.*``
    where the files came from there); so is a ``tls://`` address with no certificate anywhere.
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
        check_tls_files(
            {
                DASK_TLS_KEYS["ca_file"]: getattr(security, "tls_ca_file", None),
                DASK_TLS_KEYS["cert_file"]: getattr(security, "tls_client_cert", None),
                DASK_TLS_KEYS["key_file"]: getattr(security, "tls_client_key", None),
            },
            " (Dask's configuration, e.g. ~/.config/dask/distributed.yaml)",
        )
        return security
    files = {"ca_file": runtime.tls.ca_file, "cert_file": runtime.tls.cert_file, "key_file": runtime.tls.key_file}
    check_tls_files({f"runtime.tls.{key}": path for key, path in files.items()})
    return Security(
        tls_ca_file=files["ca_file"],
        tls_client_cert=files["cert_file"],
        tls_client_key=files["key_file"],
        require_encryption=True,
    )


class _Encrypted(Exception):
    """(Raised from the password callback: the key file is encrypted, which Dask cannot use.)"""


def _ask_password() -> str:
    raise _Encrypted


def check_tls_files(files: dict[str, str | None], where: str = "") -> None:
    """The CA file, certificate and key (``key -> path``, in that order; no key: the certificate's file holds it)
    load as Dask will load them; else a ``ConfigError`` naming the key at fault (``where``: where those keys live).

    Without this, a missing file, a key that is not a PEM key, or a key of another
    certificate surfaced as a failed connection after Dask's retries ("[SSL] PEM lib",
    "No such file or directory") with no word of which file; an encrypted key made
    OpenSSL ask for its pass phrase on the terminal. Values that hold PEM text
    themselves (Dask accepts those) are left to Dask.
    """
    import ssl

    (ca_key, ca), (cert_key, cert), (key_key, key) = files.items()
    if any(path is not None and "\n" in path for path in (ca, cert, key)):
        return
    for name, path in files.items():
        if path is not None and (not os.access(path, os.R_OK) or not Path(path).is_file()):
            raise ConfigError(f"{name}: {path} is not a file this process can read{where}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for name, path in ((ca_key, ca), (cert_key, cert)):
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
        except ssl.SSLError as exc:
            raise ConfigError(f"{name}: {path} holds no PEM certificate ({exc.reason or exc}){where}") from None
    holder = f"{key_key}: {key}" if key is not None else f"{cert_key}: {cert} (no {key_key} given)"
    try:
        context.load_cert_chain(cert or "", key, password=_ask_password)
    except _Encrypted:
        raise ConfigError(
            f"{holder}: the private key is encrypted; Dask reads keys without a pass phrase "
            f"(`openssl pkey -in KEY -out PLAIN_KEY`, then chmod 600){where}"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{holder}: not the key of the certificate {cert} ({cert_key}){where}") from None
        raise ConfigError(f"{holder}: holds no PEM private key ({exc.reason or exc}){where}") from None


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
        ca = "runtime.tls.ca_file" if runtime.tls is not None else f"Dask's {DASK_TLS_KEYS['ca_file']}"
        tls = (
            f" The scheduler must trust the CA of {ca} (its --tls-ca-file) and hold a certificate that CA signed;"
            " a tls:// client cannot reach a tcp:// scheduler."
            if security is not None
            else " A tcp:// client cannot reach a tls:// scheduler."
            if address.startswith("tcp://")
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


def _probe_here(probe: str, token: str, data_root: str, dask_worker: Any = None) -> str | None:
    """(On a worker.) Read this process's file in ``probe``, write one back; what went wrong, or None.

    ``data_root``: the prepared data, which the worker must read too (its manifest).
    """
    name = str(dask_worker.name) if dask_worker is not None else "worker"
    folder = Path(probe)
    try:
        seen = (folder / ORCHESTRATOR_FILE).read_text(encoding="utf-8")
    except OSError as exc:
        return f"does not see the run folder: it cannot read {folder / ORCHESTRATOR_FILE} ({exc.strerror or exc})"
    if seen != token:
        return f"sees another run folder at {folder.parent}: {folder / ORCHESTRATOR_FILE} holds another token"
    mine, tmp = folder / name, folder / f".{name}.tmp"
    try:
        tmp.write_text(f"{token} {name}", encoding="utf-8")
        os.replace(tmp, mine)
        if mine.read_text(encoding="utf-8") != f"{token} {name}":
            return f"cannot write in the run folder {folder.parent}: {mine} reads back otherwise"
    except OSError as exc:
        return f"cannot write in the run folder {folder.parent} ({exc.strerror or exc}: {exc.filename or mine})"
    manifest = Path(data_root) / MANIFEST_NAME
    if not os.access(manifest, os.R_OK):
        return f"does not see the data cache: it cannot read {manifest}"
    return None


def check_shared_folders(
    address: str, runtime: RuntimeConfig, run_root: Path, run_path: Path, data_root: Path, workers: list[dict[str, str]]
) -> None:
    """Every worker in ``workers`` reads a file this process wrote in the run folder, writes one back and sees
    the data cache; else ``SharedFolderError`` naming each worker that does not, with the fix.

    ``run_root``: the run directory (``--run-dir``) that holds the run folder and the data cache.
    """
    token = secrets.token_hex(16)
    probe = run_path / f"{PROBE_PREFIX}{token[:8]}"
    probe.mkdir()
    try:
        (probe / ORCHESTRATOR_FILE).write_text(token, encoding="utf-8")
        with connected(address, runtime) as client:
            by_name = {str(w["name"]): a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
            targets = {by_name[w["name"]]: w["name"] for w in workers if w["name"] in by_name}
            answers = client.run(_probe_here, str(probe), token, str(data_root), workers=list(targets))
        problems = [
            f"worker {name} ({where}) {problem}"
            for where, name in targets.items()
            if (problem := _problem(answers.get(where, "did not answer"), probe / name, f"{token} {name}"))
        ]
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    if problems:
        raise SharedFolderError(
            f"{'; '.join(problems)}. Every worker of the Dask cluster at {address} must see the run folder "
            f"{run_path} and the data cache {data_root} at these same paths: mount the run directory {run_root} "
            f"(NFS, Lustre, a bind mount) at {run_root} on every worker's machine (docs/runtime.md, \"A cluster of "
            'your own"). Nothing was trained.'
        )


def _problem(answer: str | None, written: Path, expected: str) -> str | None:
    """A worker's answer, or (when it saw no problem) whether this process sees the file it wrote."""
    if answer is not None:
        return answer
    try:
        if written.read_text(encoding="utf-8") == expected:
            return None
    except OSError:
        pass
    return f"writes its files somewhere this machine does not see ({written} is not its file)"
