"""Progress of a run as log records: root rounds, node rounds, notes.

The pipeline reports progress through the ``bhfl.progress`` logger (whichever process
or subflow runs the node); whoever wants to show it attaches a handler. The CLI's
``RichReporter`` is such a handler: a bar for the root's rounds plus a line naming the
last finished node round. Nothing is looked up in a process-global registry.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

LOGGER = logging.getLogger("bhfl.progress")
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


class RichReporter(logging.Handler):
    """Shows ``bhfl.progress`` records as a live bar (root rounds) and notes on a rich console."""

    def __init__(self, console: Console | None = None) -> None:
        super().__init__(logging.INFO)
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[detail]}"),
            console=self.console,
            transient=False,
        )
        self.task: Any = None

    def emit(self, record: logging.LogRecord) -> None:
        event: tuple[str, dict[str, Any]] = getattr(record, _EVENT, ("note", {"text": record.getMessage()}))
        kind, data = event
        if kind == "start":
            if self.task is None:
                self.progress.start()
                self.task = self.progress.add_task(
                    "root rounds", total=data["total"], completed=data["done"], detail=""
                )
        elif kind == "node_round":
            metrics = data["metrics"]
            loss = metrics.get("train/loss", metrics.get("proxy_train/loss"))
            detail = f"{'  ' * data['depth']}{data['node']} round {data['round'] + 1}" + (
                f"  loss {loss:.3f}" if loss is not None else ""
            )
            if self.task is not None:
                self.progress.update(self.task, detail=detail, advance=1 if data["depth"] == 0 else 0)
        else:
            self.progress.console.print(data["text"], highlight=False, soft_wrap=True)

    def stop(self) -> None:
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
