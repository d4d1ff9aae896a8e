"""The ``bhfl`` executable: stop signals are handled from its first line, then the application runs.

The handlers (flows/cli/stopping.py) go in before anything else is imported, so a
Ctrl-C, SIGTERM or SIGHUP while the command loads ends it like one that comes later:
one line, exit 128 + the signal. Whatever the application ends with after a stop was
asked for (typer's exit 130 for any ``KeyboardInterrupt``, an error raised while a
library unwound) becomes that exit code. Only the interpreter's own start (~20 ms,
before this module runs) is left to the signals' default actions.
"""

from __future__ import annotations

from collections.abc import Callable

from flows.cli.stopping import run_command


def main(app: Callable[[], object] | None = None) -> None:
    """Run ``app`` (the ``bhfl`` application by default) as the command of this process (``stopping.run_command``)."""
    run_command(_bhfl if app is None else lambda: app)


def _bhfl() -> Callable[[], object]:
    """The ``bhfl`` application, imported once the stop handlers are in."""
    from flows.cli.app import app

    return app


if __name__ == "__main__":
    main()
