"""The CLI's progress display when its output is not a terminal: one line per root round, with an ETA."""

import io

from rich.console import Console

from flows import progress


def test_a_log_file_gets_one_line_per_root_round_with_elapsed_and_eta(monkeypatch):
    clock = iter([100.0, 130.0, 190.0])  # start; root round 2 after 30 s; round 3 after 90 s
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    reporter = progress.RichReporter(Console(file=out, force_terminal=False, width=60))
    with reporter.attached():
        progress.run_started(6, 1)  # a resumed run: round 1 was done before this attempt
        progress.node_round("edge-en", 2, 1, {"Training/loss": 1.25})  # below the root: no line
        progress.node_round("root", 0, 1, {"Training/proxy_loss": 0.5})
        progress.note("evaluated 40 models after root round 2")
        progress.node_round("root", 0, 2, {})
    lines = out.getvalue().splitlines()
    # this attempt's pace: 30 s a round for 4 rounds left, then 45 s a round for 3 left
    assert lines == [
        "root round 2/6 done  elapsed 00:00:30  ETA 00:02:00  loss 0.500",
        "evaluated 40 models after root round 2",
        "root round 3/6 done  elapsed 00:01:30  ETA 00:02:15",
    ]
