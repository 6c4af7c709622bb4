"""The warnings a vLLM logger emits while a block runs.

vLLM's loggers do not propagate to the root logger that pytest's caplog
listens on, so a test that checks what a refusal logs attaches its own
handler to the module's logger for the duration."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def warnings_of(logger_name: str) -> Iterator[list[str]]:
    """Yield a list that holds, once the block ends, the messages of the
    warnings `logger_name` logged in it."""
    log = logging.getLogger(logger_name)
    records, level = _Records(), log.level
    found: list[str] = []
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    try:
        yield found
    finally:
        log.removeHandler(records)
        log.setLevel(level)
        found.extend(
            r.getMessage() for r in records.records if r.levelno == logging.WARNING
        )
