"""Where qir's log lines go: to stderr by default, to the application's logging once it has any.

qir logs when a kernel compile starts and how long it took, and when the compile cache falls back
to memory. A cold compile takes seconds; without a line saying so, that pause looks like a hang.
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

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
LOGGER = "qir"


class _UntilConfigured(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if self._others(logging.getLogger(record.name)):
            return  # the application's own handlers get the record
        try:
            # sys.stderr at the time of the record, so redirections (and pytest's capture) apply
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)

    def _others(self, logger: logging.Logger | None) -> bool:
        """Whether a handler besides this one sees records of `logger` (as propagation would)."""
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


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
