"""Where qir's log lines go: to stderr by default, to the application's logging once it has any.

qir logs a line per batch of kernel compiles (how many compiled, of how many, in how long; on a
terminal a bar redrawn in place while they run, see `Progress`), and when the compile cache falls
back to memory. A cold compile takes seconds; without a line saying so, that pause looks like a
hang. Each compile's own start and duration are debug records (`QIR_LOG=debug`, `qir -v`).
Python's default is to drop INFO records of a library nobody configured, so qir installs one
handler on its "qir" logger that prints `qir: <message>` to stderr, but only while no other
handler would see the record. An application (or pytest) that configures logging, on the root
logger or on "qir", receives qir's records there instead, formatted its own way, and never twice.

`QIR_LOG` sets the level of the "qir" logger: debug, info (the default), warning or error. The
default is info even where the application set its root logger to warning: compile lines are
the point. `QIR_LOG=warning`, or `logging.getLogger("qir").setLevel(...)`, turns them off.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
LOGGER = "qir"


class _UntilConfigured(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if self.others(logging.getLogger(record.name)):
            return  # the application's own handlers get the record
        try:
            # sys.stderr at the time of the record, so redirections (and pytest's capture) apply
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)

    def others(self, logger: logging.Logger | None) -> bool:
        """Whether a handler besides this one sees records of `logger` (as propagation would)."""
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


def _prints_itself(logger: logging.Logger) -> bool:
    """Whether qir's own handler writes `logger`'s info records to stderr (no application
    handler takes them)."""
    ours = [h for h in logging.getLogger(LOGGER).handlers if isinstance(h, _UntilConfigured)]
    return bool(ours) and logger.isEnabledFor(logging.INFO) and not ours[0].others(logger)


class Progress:
    """A batch of work (kernel compiles) as one line on stderr. On a terminal, while nothing
    else handles qir's records, a bar redrawn in place (carriage return) as steps finish; in any case the
    summary given to `finish` as one info record (which replaces the bar). Thread-safe."""

    WIDTH = 24

    def __init__(self, logger: logging.Logger, what: str, total: int) -> None:
        self.logger, self.what, self.total = logger, what, total
        self.done = 0
        self.start = time.perf_counter()
        self._lock = threading.Lock()
        self._drawn = 0  # characters of the bar on screen

    def step(self, show: bool = True) -> None:
        """One step finished; `show`: draw the bar (else only count, e.g. a cache hit before
        anything had to compile)."""
        with self._lock:
            self.done += 1
            if show and sys.stderr.isatty() and _prints_itself(self.logger):
                filled = self.WIDTH * self.done // max(self.total, 1)
                bar = "#" * filled + "." * (self.WIDTH - filled)
                seconds = time.perf_counter() - self.start
                line = f"qir: {self.what} [{bar}] {self.done}/{self.total} {seconds:.1f} s"
                print("\r" + line.ljust(self._drawn), end="", file=sys.stderr, flush=True)
                self._drawn = len(line)

    def finish(self, summary: str | None) -> None:
        """Clear the bar and log `summary` (nothing when None)."""
        with self._lock:
            if self._drawn:
                print("\r" + " " * self._drawn + "\r", end="", file=sys.stderr, flush=True)
                self._drawn = 0
        if summary:
            self.logger.info(summary)


def setup() -> None:
    """Configure the "qir" logger; idempotent (runs when qir is imported). Its level comes from
    `QIR_LOG`, else stays what the application set before importing qir, else info."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(h, _UntilConfigured) for h in logger.handlers):
        handler = _UntilConfigured()
        handler.setFormatter(logging.Formatter("qir: %(message)s"))
        logger.addHandler(handler)
    raw = os.environ.get("QIR_LOG", "").strip().lower()
    if raw in LEVELS:
        logger.setLevel(LEVELS[raw])
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if raw and raw not in LEVELS:
        logger.warning("QIR_LOG=%s is not one of %s; logging at info", raw, ", ".join(LEVELS))
