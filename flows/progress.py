"""Progress of a run as log records: root rounds, node rounds, notes.

The pipeline reports progress through the ``bhfl.progress`` logger (whichever process
or subflow runs the node); whoever wants to show it attaches a handler. The CLI's
``RichReporter`` is such a handler: a bar for the root's rounds plus a line naming the
last finished node round. Nothing is looked up in a process-global registry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

LOGGER = logging.getLogger("bhfl.progress")
# progress is INFO by design: handlers (the CLI's reporter, Prefect's API handler) decide what shows where
LOGGER.setLevel(logging.INFO)
_EVENT = "bhfl_event"


def run_started(total_root_rounds: int, done: int = 0) -> None:
    LOGGER.info(
        "root rounds: %d of %d done",
        done,
        total_root_rounds,
        extra={_EVENT: ("start", {"total": total_root_rounds, "done": done})},
    )


def node_round(node_id: str, depth: int, round_index: int, metrics: dict[str, float]) -> None:
    LOGGER.info(
        "%s round %d done",
        node_id,
        round_index + 1,
        extra={_EVENT: ("node_round", {"node": node_id, "depth": depth, "round": round_index, "metrics": metrics})},
    )


def note(text: str) -> None:
    LOGGER.info(text, extra={_EVENT: ("note", {"text": text})})


def _clock(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(seconds))


class RichReporter(logging.Handler):
    """Shows ``bhfl.progress`` records as a live bar (root rounds, elapsed, ETA) and notes on a rich console.

    On a console that is not a terminal (output to a file, CI logs) a live bar shows
    nothing until the end, so each finished root round is also one plain line with the
    elapsed time and the estimated time left.
    """

    def __init__(self, console: Console | None = None) -> None:
        super().__init__(logging.INFO)
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[detail]}"),
            console=self.console,
            transient=False,
        )
        self.task: Any = None
        self.total = self.done_at_start = 0
        self.started = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        event: tuple[str, dict[str, Any]] = getattr(record, _EVENT, ("note", {"text": record.getMessage()}))
        kind, data = event
        if kind == "start":
            if self.task is None:
                self.total, self.done_at_start, self.started = data["total"], data["done"], time.monotonic()
                if self.console.is_terminal:
                    self.progress.start()
                self.task = self.progress.add_task(
                    "root rounds", total=data["total"], completed=data["done"], detail=""
                )
        elif kind == "node_round":
            metrics = data["metrics"]
            loss = metrics.get("Training/loss", metrics.get("Training/proxy_loss"))
            detail = f"{'  ' * data['depth']}{data['node']} round {data['round'] + 1}" + (
                f"  loss {loss:.3f}" if loss is not None else ""
            )
            if self.task is not None:
                self.progress.update(self.task, detail=detail, advance=1 if data["depth"] == 0 else 0)
                if data["depth"] == 0 and not self.console.is_terminal:
                    self.console.print(self._round_line(data["round"] + 1, loss), highlight=False, soft_wrap=True)
        else:
            self.progress.console.print(data["text"], highlight=False, soft_wrap=True)

    def _round_line(self, done: int, loss: float | None) -> str:
        """``root round 3/8 done  elapsed 0:00:41  ETA 0:01:08  loss 0.912`` (ETA from this attempt's pace)."""
        elapsed = time.monotonic() - self.started
        ran = done - self.done_at_start
        eta = _clock(elapsed / ran * (self.total - done)) if ran > 0 else "?"
        return f"root round {done}/{self.total} done  elapsed {_clock(elapsed)}  ETA {eta}" + (
            f"  loss {loss:.3f}" if loss is not None else ""
        )

    def stop(self) -> None:
        if self.progress.live.is_started:
            self.progress.stop()

    @contextmanager
    def attached(self) -> Iterator[RichReporter]:
        """Show the pipeline's progress while the block runs."""
        previous = LOGGER.level
        LOGGER.setLevel(logging.INFO)
        LOGGER.addHandler(self)
        try:
            yield self
        finally:
            LOGGER.removeHandler(self)
            LOGGER.setLevel(previous)
            self.stop()
