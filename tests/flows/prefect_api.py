"""Plain HTTP calls to a Prefect server's REST API, retried like Prefect's own client retries them.

A Prefect server on SQLite answers 503 when a write waits too long for the database lock
(a busy machine, several runs writing at once); Prefect's client retries 429/502/503 with
exponential backoff, so the tests' direct calls do the same instead of failing on it.
"""

import json
import time
import urllib.error
import urllib.request

RETRY_CODES = {429, 502, 503}


def api(url: str, body: dict | None = None, *, method: str | None = None, attempts: int = 6):
    """GET ``url`` (or POST ``body``) and return the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json"},
        method=method or ("GET" if body is None else "POST"),
    )
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code not in RETRY_CODES or attempt == attempts - 1:
                raise
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")
