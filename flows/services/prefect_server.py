"""A Prefect API server owned by this process, which dies with it.

Prefect's own temporary server (used when ``PREFECT_API_URL`` is unset) outlives a
process killed with SIGKILL: the orphan keeps the run folder's Prefect database open,
and a resumed run would start a second server on the same SQLite file. So the CLI
starts the server itself, on 127.0.0.1, asking Linux to SIGTERM it when its parent
dies (``PR_SET_PDEATHSIG``), and points ``PREFECT_API_URL`` at it before Prefect is
imported. ``full=False`` is the same server Prefect starts as its temporary one (API
only); ``full=True`` is ``prefect server start`` (UI and services, e.g. the scheduler
that ``bhfl serve`` needs). The server starts in the background (``start_server``
returns at once) so the command does its other start-up work meanwhile.

The server runs in a process group of its own: Ctrl-C at the terminal reaches the
command, which then still has a server to record the interruption in, and stops it
itself. ``watch`` tells the command when the server dies under it (docs/runtime.md,
"Faults": the command stops at once rather than retrying against a dead API).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Self

from flows.services.processes import die_with_parent
from flows.services.store_templates import save_template, seed

# set while this process's own server runs: its SQLite file (what a full disk under it is judged by:
# flows/cli/full_disk.py); a server of the user's (PREFECT_API_URL) is not ours to judge
OWN_DATABASE_ENV = "BHFL_OWN_PREFECT_DATABASE"


def free_port(preferred: int | None = None) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred or 0))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never via $http_proxy


def wait_healthy(api_url: str, timeout_s: float, proc: subprocess.Popen | None = None, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {proc.returncode} before it was ready")
        try:
            with _NO_PROXY.open(f"{api_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"the Prefect server at {api_url} did not answer within {timeout_s:.0f} s")


USER_SERVER_GRACE_S = 3.0  # a server of the user's that does not listen yet: how long to look again


def unreachable(api_url: str, grace_s: float = USER_SERVER_GRACE_S) -> str | None:
    """Why nothing answers at ``api_url`` (a Prefect server of the user's, ``PREFECT_API_URL``); None: it listens.

    The connection is tried, then (not for Prefect Cloud, which answers only with its key)
    the call Prefect's client makes first, ``GET /admin/version`` (``not_prefect``):
    Prefect's client would otherwise retry a refused connection for ~20 s and end the
    command with httpx's traceback, or meet a web server that is no Prefect API
    (``Failed to reach API``) after the run's folder and MLflow store were made.
    """
    from urllib.parse import urlsplit

    parts = urlsplit(api_url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:  # a port that is no number
        return f"not a URL of a Prefect API such as http://127.0.0.1:4200/api ({exc})"
    if parts.scheme not in ("http", "https") or not host:
        return "not a URL of a Prefect API such as http://127.0.0.1:4200/api"
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(host):
        return None  # reached through a proxy (as Prefect's client does): a direct connection says nothing
    deadline = time.monotonic() + grace_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=5):
                pass
            return None if host.endswith(PREFECT_CLOUD) else not_prefect(api_url)
        except OSError as exc:
            if time.monotonic() >= deadline:
                return f"nothing answers at {host}:{port} ({exc.strerror or exc})"
        time.sleep(0.25)


PREFECT_CLOUD = "prefect.cloud"  # api.prefect.cloud: its API answers only with the workspace's key


def not_prefect(api_url: str, timeout_s: float = 10.0) -> str | None:
    """Why what answers at ``api_url`` is no Prefect server this bhfl can use; None: it is one, or no definite
    answer came (a key this probe does not send, a timeout: Prefect's client, with its key and retries, judges then).

    ``GET <api>/admin/version``, as Prefect's client does before its first call (it fails
    with ``Failed to reach API`` on anything but a version, and refuses another major version).
    """
    import json

    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/admin/version", timeout=timeout_s) as resp:
            body = resp.read(1000)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):  # a server behind PREFECT_API_KEY / PREFECT_API_AUTH_STRING
            return None
        return (
            f"something answers there, but not as a Prefect API (GET /admin/version: HTTP {exc.code} {exc.reason}; "
            "a Prefect server's API is http://HOST:4200/api)"
        )
    except (urllib.error.URLError, OSError):  # slow (a loaded machine) or cut: not a definite answer, Prefect retries
        return None
    try:
        version = json.loads(body)
        major = int(str(version).split(".")[0])
    except ValueError:
        return f"something answers there, but not as a Prefect API (GET /admin/version: {body[:60]!r})"
    ours = importlib.metadata.version("prefect")
    if major != int(ours.split(".")[0]):
        return f"it is Prefect {version}; this bhfl's Prefect is {ours}, and the major versions must match"
    return None


class PrefectServer:
    """A Prefect API server this process started; it may still be booting (``wait_healthy``)."""

    def __init__(self, proc: subprocess.Popen, api_url: str, database: Path | None, log_file: Path) -> None:
        self.proc, self.api_url, self.database, self.log_file = proc, api_url, database, log_file
        self._healthy = False
        self._stopping = False

    def wait_healthy(self, timeout_s: float = 180) -> None:
        """Block until the server answers; a new database it migrated becomes the template for the next ones."""
        if self._healthy:
            return
        try:
            wait_healthy(self.api_url, timeout_s, self.proc)
        except BaseException:
            self.stop()
            raise
        self._healthy = True
        if self.database is not None:
            save_template(self.database, "prefect", prefect_version())

    def watch(self, on_death: Callable[[int], None]) -> None:
        """Call ``on_death(returncode)`` from a watcher thread if the server exits before ``stop`` is called."""

        def wait() -> None:
            code = self.proc.wait()
            if not self._stopping:
                on_death(code)

        threading.Thread(target=wait, name="bhfl-prefect-server-watch", daemon=True).start()

    def stop(self) -> None:
        """SIGTERM (uvicorn shuts down gracefully), SIGKILL after 15 s; a no-op once it has exited."""
        self._stopping = True
        os.environ.pop(OWN_DATABASE_ENV, None)
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def prefect_version() -> str:
    return importlib.metadata.version("prefect")


def own_database(env: Mapping[str, str]) -> Path | None:
    """The SQLite file the server will use, unless the user configured a database of their own."""
    if "PREFECT_API_DATABASE_CONNECTION_URL" in env or "PREFECT_SERVER_DATABASE_CONNECTION_URL" in env:
        return None  # e.g. Postgres: not ours to seed, nor to copy from
    return Path(env.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser() / "prefect.db"


def start_server(log_file: Path, full: bool, port: int | None = None) -> PrefectServer:
    """Start a Prefect server on 127.0.0.1 (database under ``$PREFECT_HOME``) and return at once.

    Call it from a thread that outlives the server (Linux sends the death signal when the
    forking thread ends; the CLI calls it from its main thread). Call ``wait_healthy`` on
    the result before the first request (the server boots in ~3-4 s of CPU, mostly
    imports) and ``stop`` at the end. A new database starts as a
    copy of the migrated template of this Prefect version (flows/services/store_templates.py):
    ~6 s of migrations and ~0.5 s of block registration saved; a new database that
    migrated itself becomes that template once the server answers.
    """
    port = free_port(port)
    env = os.environ.copy()
    database = own_database(env)
    if database is not None:
        os.environ[OWN_DATABASE_ENV] = str(database)
    created = database is not None and not database.exists()
    seeded = created and seed(database, "prefect", prefect_version())  # type: ignore[arg-type]
    if full:
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    else:
        spec = importlib.util.find_spec("prefect")
        assert spec is not None and spec.submodule_search_locations
        app_dir = str(Path(next(iter(spec.submodule_search_locations))).parent)
        cmd = [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            app_dir,
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ]
        env.update({"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"})
        if seeded:  # the template has them (store_templates checks), so skip re-registering
            env.setdefault("PREFECT_API_BLOCKS_REGISTER_ON_START", "false")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,  # noqa: PLW1509 (prctl resolved before fork; it takes no lock)
            process_group=0,  # not the terminal's: Ctrl-C reaches the command, which stops the server after
        )
    return PrefectServer(proc, f"http://127.0.0.1:{port}/api", database if created and not seeded else None, log_file)
