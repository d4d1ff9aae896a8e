"""The hub probe's cache: an outcome stands for its time-to-live, then the hub is asked again (no network)."""

from bhfl_core.learning.hub import PROBE_TIMEOUT_S, PROBE_TTL_S, ProbeCache


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_probe_outcome_stands_for_its_ttl_then_the_hub_is_asked_again():
    answers = iter(["ConnectError: refused", None, None])
    asked: list[tuple[str, float]] = []

    def probe(url: str, timeout_s: float) -> str | None:
        asked.append((url, timeout_s))
        return next(answers)

    clock = Clock()
    probes = ProbeCache(probe, clock=clock)
    assert probes("https://hub") == "ConnectError: refused"
    clock.now += PROBE_TTL_S - 1  # the CLI's second check, within the TTL: no second probe
    assert probes("https://hub") == "ConnectError: refused"
    assert len(asked) == 1
    clock.now += 1  # the TTL is over: a hub that came back is seen
    assert probes("https://hub") is None
    assert probes("https://other", 1.0) is None  # another endpoint (and timeout) is its own entry
    assert asked == [("https://hub", PROBE_TIMEOUT_S), ("https://hub", PROBE_TIMEOUT_S), ("https://other", 1.0)]
