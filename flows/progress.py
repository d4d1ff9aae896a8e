"""Progress reporting: a rich live view of root rounds and the node currently running."""

from __future__ import annotations

from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class Reporter(Protocol):
    def start(self, total_root_rounds: int, done: int = 0) -> None: ...
    def node_round(self, node_id: str, depth: int, round_index: int, metrics: dict[str, float]) -> None: ...
    def note(self, text: str) -> None: ...
    def stop(self) -> None: ...


class SilentReporter:
    def start(self, total_root_rounds: int, done: int = 0) -> None: ...
    def node_round(self, node_id: str, depth: int, round_index: int, metrics: dict[str, float]) -> None: ...
    def note(self, text: str) -> None: ...
    def stop(self) -> None: ...


class RichReporter:
    """A bar for the root's rounds plus a line naming the last finished node round."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[detail]}"), console=self.console, transient=False,
        )
        self.task = None

    def start(self, total_root_rounds: int, done: int = 0) -> None:
        self.progress.start()
        self.task = self.progress.add_task("root rounds", total=total_root_rounds, completed=done, detail="")

    def node_round(self, node_id: str, depth: int, round_index: int, metrics: dict[str, float]) -> None:
        loss = metrics.get("train/loss", metrics.get("proxy_train/loss"))
        detail = f"{'  ' * depth}{node_id} round {round_index + 1}" + (f"  loss {loss:.3f}" if loss is not None else "")
        if self.task is not None:
            self.progress.update(self.task, detail=detail, advance=1 if depth == 0 else 0)

    def note(self, text: str) -> None:
        self.progress.console.print(text)

    def stop(self) -> None:
        self.progress.stop()
