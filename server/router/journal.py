"""An append-only JSON-lines journal that never fails the request it records, and never hides a loss.

A write that fails (full disk, I/O error, a short write) is *dropped*, not raised: the request it
describes was served, and the client's answer must not depend on the journal's disk. What a drop does
instead:

- the line is cut back out if a part of it reached the file (``ftruncate`` to the size before it), so
  the journal never holds a torn line;
- it is counted (``dropped``; the router exports ``distserve_journal_dropped_total``) and the router's
  ``/health`` says ``degraded`` with ``reason()`` while the journal is failing or dropped a line in the
  last ``DEGRADED_FOR_S`` seconds;
- the journal itself records the gap, so an audit of the period knows records are missing:
  ``{"kind": "journal_gap", "since_unix": ..., "open": true}`` at the first drop of a run (written
  into the space of a small reserve file kept beside the journal, freed for it, so the marker fits on
  a full disk), and ``{"kind": "journal_gap", "since_unix", "until_unix", "dropped": N}`` before the
  next line that is written again (or at close). ``sla/records.py`` reads both; an audit whose
  period has a gap says ``incomplete`` instead of passing availability.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

DEGRADED_FOR_S = 60.0
RESERVE_BYTES = 4096


class Journal:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self.dropped = 0  # lines lost since start
        self.error: str | None = None  # the last write error while failing; None once writes succeed
        self._fd: int | None = None
        self._size = 0
        self._gap_since: float | None = None  # wall time of the first drop of the current run of drops
        self._gap_dropped = 0
        self._last_drop_mono: float | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._size = os.fstat(self._fd).st_size
            self._reserve()

    @property
    def _reserve_path(self) -> str:
        return f"{self.path}.reserve"

    def _reserve(self) -> None:
        try:
            fd = os.open(self._reserve_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, b"\0" * RESERVE_BYTES)
            finally:
                os.close(fd)
        except OSError:
            pass  # no room for the reserve either: the gap marker may then be lost with the lines

    def _write(self, data: bytes) -> None:
        """Write ``data`` whole or not at all (a partial write is cut back); raise OSError on failure."""
        assert self._fd is not None
        done = 0
        try:
            while done < len(data):
                n = os.write(self._fd, data[done:])
                if n <= 0:
                    raise OSError(f"short write ({done} of {len(data)} bytes)")
                done += n
        except OSError:
            if done:
                try:
                    os.ftruncate(self._fd, self._size)
                except OSError:
                    pass
            raise
        self._size += len(data)

    @staticmethod
    def _line(obj: dict) -> bytes:
        return (json.dumps(obj, separators=(",", ":")) + "\n").encode()

    def append(self, obj: dict) -> bool:
        """Write one line; False when it was dropped (see the module docstring). Never raises OSError."""
        if self._fd is None:
            return True
        try:
            if self._gap_since is not None:  # writes work again: close the gap first
                self._write(self._line(self._gap_record(time.time())))
                self._gap_since, self._gap_dropped = None, 0
                self._reserve()
            self._write(self._line(obj))
            self.error = None
            return True
        except OSError as e:
            self._dropped(e)
            return False

    def _gap_record(self, until: float | None) -> dict:
        rec: dict = {"kind": "journal_gap", "since_unix": round(self._gap_since or 0.0, 6)}
        if until is None:
            rec["open"] = True
        else:
            rec.update(until_unix=round(until, 6), dropped=self._gap_dropped)
        return rec

    def _dropped(self, e: OSError) -> None:
        self.dropped += 1
        self._gap_dropped += 1
        self._last_drop_mono = time.monotonic()
        self.error = e.strerror or str(e)
        if self._gap_since is None:
            self._gap_since = time.time()
            try:  # free the reserve so the marker fits on a full disk
                os.unlink(self._reserve_path)
            except OSError:
                pass
            try:
                self._write(self._line(self._gap_record(None)))
            except OSError:
                pass

    def reason(self) -> str | None:
        """Why ``/health`` is degraded because of this journal, or None."""
        recent = self._last_drop_mono is not None and time.monotonic() - self._last_drop_mono < DEGRADED_FOR_S
        if self.error is None and not recent:
            return None
        state = f"failing ({self.error})" if self.error else "recovered"
        return f"journal {self.path}: {self.dropped} records dropped, {state}"

    def close(self) -> None:
        if self._fd is None:
            return
        if self._gap_since is not None:
            try:
                self._write(self._line(self._gap_record(time.time())))
            except OSError:
                pass
        os.close(self._fd)
        self._fd = None
        try:
            os.unlink(self._reserve_path)
        except OSError:
            pass
