"""Progress of the long steps (reading a corpus, training a tokenizer) for a person watching, terminal or not.

:class:`Progress` counts towards a known total: a tqdm bar on a terminal, otherwise an INFO log line every
``interval`` seconds with the count, the percentage, the rate and an ETA (logs, CI and ``nohup`` runs get an ETA too).
:class:`Heartbeat` covers a phase whose length nobody knows in advance (a trainer's merges): the elapsed time, on the
terminal's status line or as a log line every ``interval`` seconds, and its duration at the end.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType
from typing import IO, Any

__all__ = ["Progress", "Heartbeat", "format_duration", "is_terminal"]

logger = logging.getLogger("mcore_data")


def is_terminal(stream: IO[str] | None = None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def format_duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``2h05m``, ``3d04h`` (also the training loop's ETA)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _amount(n: float, unit: str) -> str:
    return f"{n / 1e6:,.1f} MB" if unit == "B" else f"{n:,.0f} {unit}"


class Progress:
    """Counts ``update(n)`` towards ``total`` (``None``: unknown, no percentage or ETA). ``enabled=False``: silent."""

    def __init__(self, desc: str, total: float | None, unit: str = "B", *, enabled: bool = True,
                 interval: float = 10.0, stream: IO[str] | None = None,
                 log: logging.Logger | None = None) -> None:  # fmt: skip
        self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
        self.log = log or logger
        self.enabled = enabled
        self.n = 0.0
        self.t0 = time.monotonic()
        self._next_line = self.t0 + interval
        self.bar: Any = None
        if enabled and is_terminal(stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1000,
                            file=stream or sys.stderr, dynamic_ncols=True, mininterval=0.5)  # fmt: skip

    def update(self, n: float) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() >= self._next_line:
            self._next_line = time.monotonic() + self.interval
            self.log.info("%s", self.line())

    def line(self) -> str:
        """``desc: 12.3 / 31.5 MB (39%), 4.1 MB/s, ETA 5s`` (without the total: the count and the rate)."""
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = self.n / elapsed
        text = f"{self.desc}: {_amount(self.n, self.unit)}"
        if self.total:
            text += f" / {_amount(self.total, self.unit)} ({min(self.n / self.total, 1.0):.0%})"
        text += f", {_amount(rate, self.unit)}/s"
        if self.total and rate > 0:
            text += f", ETA {format_duration(max(self.total - self.n, 0) / rate)}"
        return text

    def close(self) -> float:
        """End the bar (or log the last line: the count and the time it took); returns the seconds it took."""
        elapsed = time.monotonic() - self.t0
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled:
            rate = self.n / max(elapsed, 1e-9)
            self.log.info("%s: %s in %s (%s/s)", self.desc, _amount(self.n, self.unit), format_duration(elapsed),
                          _amount(rate, self.unit))  # fmt: skip
        self.enabled = False
        return elapsed


class Heartbeat:
    """``with Heartbeat("computing merges"):`` shows that a step of unknown length is running: on a terminal a status
    line with the elapsed time (refreshed each second), otherwise a log line when it starts, every ``interval``
    seconds, and at the end with its duration."""

    def __init__(self, desc: str, *, enabled: bool = True, interval: float = 30.0, stream: IO[str] | None = None,
                 log: logging.Logger | None = None) -> None:  # fmt: skip
        self.desc, self.enabled, self.interval = desc, enabled, interval
        self.stream = stream or sys.stderr
        self.terminal = is_terminal(self.stream)
        self.log = log or logger
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0

    def __enter__(self) -> Heartbeat:
        self.t0 = time.monotonic()
        if self.enabled:
            if not self.terminal:
                self.log.info("%s ...", self.desc)
            self._thread = threading.Thread(target=self._beat, name="mcore-data-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        period = 1.0 if self.terminal else self.interval
        while not self._stop.wait(period):
            elapsed = format_duration(time.monotonic() - self.t0)
            if self.terminal:
                self.stream.write(f"\r{self.desc}: {elapsed} elapsed")
                self.stream.flush()
            else:
                self.log.info("%s: still running, %s elapsed", self.desc, elapsed)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.enabled:
            return
        if self.terminal:
            self.stream.write("\r\033[K")
            self.stream.flush()
        if exc_type is None:
            self.log.info("%s: done in %s", self.desc, format_duration(time.monotonic() - self.t0))
