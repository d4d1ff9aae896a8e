"""Is the Hugging Face hub reachable? One bounded probe before a hub name is loaded.

Without ``HF_HUB_OFFLINE``, huggingface_hub retries a failed request five times with
exponential backoff (1+2+4+8+8 s), so on a machine without network a hub model or
dataset costs ~30 s of retries per load before its error. The checks before a run
(``check_available``, ``data_prep.source_checks.check_sources``) call ``require_hub`` first:
one HEAD request to the hub's endpoint (``HF_ENDPOINT`` respected, through
huggingface_hub's own HTTP client, so its proxies and certificates apply), bounded by
a wall-clock deadline that covers a DNS lookup as well, and the config key's one
clear paragraph when it fails. With ``HF_HUB_OFFLINE=1`` the libraries fail at once
on their own, so no probe is made. A probe's outcome is kept for ``PROBE_TTL_S``
(``ProbeCache``): the CLI checks before it starts Prefect and again in the full
preflight, seconds apart, and a hub that is down costs up to 4 s a probe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from bhfl_core.config.base import ConfigError

PROBE_TIMEOUT_S = 3.0
PROBE_TTL_S = 60.0  # how long a probe's outcome stands for the process (``ProbeCache``)


class HubUnreachableError(ConfigError):
    """A config names a hub model or dataset and the hub cannot be reached; says how to go offline."""


def is_local(name: str) -> bool:
    """Whether a model or dataset name is a folder on this machine (loaded from it, never from the hub)."""
    return Path(name).expanduser().is_dir()


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set: the hub libraries read local files only."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def endpoint() -> str:
    """The hub the libraries talk to (``HF_ENDPOINT``, default https://huggingface.co)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``url`` cannot be reached (None: it answered, with any HTTP status); asks every time.

    Any answer counts: a proxy that intercepts every host answers too, and the load then
    fails as it would have without this check. The request runs in a daemon thread and
    is abandoned after ``timeout_s`` + 1 s: httpx's timeouts do not bound the name
    lookup, which can take far longer on a machine whose DNS server does not answer.
    """
    from huggingface_hub.utils import get_session

    outcome: list[str | None] = []

    def request() -> None:
        try:
            get_session().head(url, timeout=timeout_s, follow_redirects=False)
            outcome.append(None)
        except Exception as exc:  # httpx's connect/timeout/proxy errors, OSError: all mean "not reachable"
            outcome.append(f"{type(exc).__name__}: {str(exc).strip() or 'no detail'}"[:300])

    thread = threading.Thread(target=request, name="bhfl-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    return outcome[0] if outcome else f"no answer within {timeout_s + 1.0:.0f} s"


class ProbeCache:
    """Probe outcomes by URL, each standing for ``ttl_s`` seconds; called like ``probe``.

    Bound: one entry per URL (and timeout) probed in the last ``ttl_s``: older entries
    are dropped at every look-up, and a process probes one endpoint. Invalidation: age.
    Without it (a cache for the life of the process) a long-lived process, a sweep or a
    served deployment, would take a hub that was down once for down until it exits, and
    one that went away for still there. ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        probe: Callable[[str, float], str | None],
        ttl_s: float = PROBE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe, self._ttl_s, self._clock = probe, ttl_s, clock
        self._lock = threading.Lock()
        self._outcomes: dict[tuple[str, float], tuple[float, str | None]] = {}  # (url, timeout) -> (when, outcome)

    def __call__(self, url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
        with self._lock:
            now = self._clock()
            self._outcomes = {k: v for k, v in self._outcomes.items() if now - v[0] < self._ttl_s}
            if (key := (url, timeout_s)) in self._outcomes:
                return self._outcomes[key][1]
        outcome = self._probe(url, timeout_s)  # outside the lock: a probe may take timeout_s + 1 s
        with self._lock:
            self._outcomes[key] = (self._clock(), outcome)
        return outcome


unreachable = ProbeCache(probe)  # what ``require_hub`` asks: this process's recent probes


def require_hub(key: str, name: str, local_copy: str) -> None:
    """Fail in seconds, naming ``key`` and ``name``, when ``name`` would be loaded from an unreachable hub.

    Nothing to check for a local folder or in offline mode. ``local_copy`` ends the
    message: how to use a local copy of this kind of thing instead.
    """
    if is_local(name) or offline():
        return
    url = endpoint()
    if (reason := unreachable(url)) is None:
        return
    raise HubUnreachableError(
        f"{key}: {name!r} is a Hugging Face hub name, but the hub at {url} cannot be reached ({reason}); "
        f"loading it would retry for ~30 s and then fail. Without network access set HF_HUB_OFFLINE=1 "
        f"(then anything already in the Hugging Face cache, HF_HOME, loads from there) and use a local copy: "
        f"{local_copy}"
    )
