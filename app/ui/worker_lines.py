"""What a Ray worker writes for the driver's console: lines marked with ``MARK`` (app.ui.console prints those
and sends the rest of a worker's output to the run's log file)."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

# ASCII "record separator": starts a worker's line meant for the console; invisible if ever printed raw.
MARK = "\x1e"


class MarkedFormatter(logging.Formatter):
    """Workers' formatter for their console lines: every line of the message starts with ``MARK``."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(MARK + line for line in super().format(record).splitlines())


def mark_worker_console(logger_name: str = "app") -> None:
    """In a worker: this package's INFO lines go to stderr marked for the driver's console."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(h.formatter, MarkedFormatter) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(MarkedFormatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


class _MarkedLines:
    """A text stream that writes each whole line to ``stream`` starting with ``MARK``."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        *whole, self.pending = (self.pending + text).split("\n")
        if whole:
            self.stream.write("".join(MARK + line + "\n" for line in whole))
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str):  # encoding, errors, fileno, buffer: the stream's own (unmarked)
        return getattr(self.stream, name)


@contextlib.contextmanager
def marked_stdout() -> Iterator[None]:
    """In rank 0's worker: what Python prints (a callback's ``print``, Keras's own callback messages) is marked for
    the driver's console, as model.fit's script would show it (unmarked, a worker's output goes to the log file)."""
    marked = _MarkedLines(sys.stdout)
    with contextlib.redirect_stdout(marked):
        try:
            yield
        finally:
            if marked.pending:
                marked.write("\n")
