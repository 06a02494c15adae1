"""A misbehaving backup pool, through the real router app and a real backup socket: one that stalls
before answering, one that stalls mid-stream, one that answers 401. Each is bounded, marked unhealthy,
traffic returns to the primary (here: its 503, as it has no workers), and the router keeps no
connection to it."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.unit.test_router_failover import make_client

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b'%x\r\ndata: {"choices": [{"text": "a"}]}\n\n\r\n' % len(b'data: {"choices": [{"text": "a"}]}\n\n')
)


class RawBackup:
    """A backup server on a real socket: ``mode`` is ``stall_head``, ``stall_stream`` or ``401``.
    Counts the requests it saw and the connections the router still holds open."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.open = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self.lock:
            self.open += 1
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            with self.lock:
                self.requests += 1
            if self.mode == "401":
                body = b'{"error": {"message": "bad key"}}'
                conn.sendall(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            elif self.mode == "stall_stream":
                conn.sendall(SSE_HEAD)
            while conn.recv(65536):  # then say nothing more until the router hangs up
                pass
        except OSError:
            pass
        finally:
            conn.close()
            with self.lock:
                self.open -= 1

    def close(self) -> None:
        self.sock.close()


def _wait_closed(backup: RawBackup, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while backup.open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backup.open == 0, f"the router still holds {backup.open} connection(s) to the backup"


@pytest.mark.parametrize("mode", ["stall_head", "401"])
def test_a_backup_that_stalls_or_answers_401_is_skipped_and_the_primary_answers(tmp_path, mode):
    backup = RawBackup(mode)
    try:
        with make_client(tmp_path, [backup.url], stream_progress_timeout_s=1.0) as c:
            for stream in (False, True):
                r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream})
                assert r.status_code == 503 and r.headers["x-distserve-pool"] == "primary", r.text  # not 401
            assert backup.requests == 1  # marked unhealthy: the second request did not wait on it
        _wait_closed(backup)
    finally:
        backup.close()


def test_a_backup_that_stalls_mid_stream_is_cut_with_an_error_event_and_done(tmp_path):
    backup = RawBackup("stall_stream")
    try:
        with make_client(tmp_path, [backup.url], stream_progress_timeout_s=1.0) as c:
            t0 = time.monotonic()
            with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True}) as r:
                assert r.headers["x-distserve-pool"] == "backup"
                text = "".join(r.iter_text())
            assert time.monotonic() - t0 < 15
            assert text.startswith('data: {"choices"') and '"error"' in text and text.endswith("data: [DONE]\n\n")
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and backup.requests == 1  # unhealthy now: back to the primary
        _wait_closed(backup)
        lines = (tmp_path / "j.jsonl").read_text().splitlines()
        assert any('"pool":"backup"' in x and "stream broke" in x for x in lines), lines
    finally:
        backup.close()
