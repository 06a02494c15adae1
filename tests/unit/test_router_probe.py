"""The launcher's router probe: a router that answers nothing is restarted only when it is frozen (no CPU
used: SIGSTOP, a lock wait), not while it is busy (a burst stalls its loop for seconds), and in any case after
``busy_unanswered_s`` without an answer. Real processes; the probe's clock is passed in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from distserve.server.launcher import RouterProbe, process_cpu_s


def _probe_for(pid: int, seconds: int, probe: RouterProbe, t0: float) -> list[bool]:
    """One failed probe per (fake) second while real time passes in 0.25 s steps; frozen() after each."""
    out = []
    for i in range(1, seconds + 1):
        time.sleep(0.25)
        probe.progressed(pid, t0 + i)
        out.append(probe.frozen(t0 + i))
    return out


def test_a_busy_router_is_not_frozen_and_a_stopped_one_is():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert (process_cpu_s(spin.pid) or 0.0) >= 0.0
        probe = RouterProbe(frozen_after_s=5.0, busy_unanswered_s=60.0)
        t0 = time.monotonic()
        probe.reset(t0)
        # busy: 10 s without an answer, CPU moving all along -> never frozen
        assert not any(_probe_for(spin.pid, 10, probe, t0))
        # ...until it has answered nothing for busy_unanswered_s
        probe.progressed(spin.pid, t0 + 61)
        assert probe.frozen(t0 + 61)

        os.kill(spin.pid, signal.SIGSTOP)
        time.sleep(0.1)
        probe.reset(t0)
        frozen = _probe_for(spin.pid, 8, probe, t0)
        # stopped: frozen once frozen_after_s passed without an answer and without CPU (one tick of slack)
        assert not any(frozen[:4]) and all(frozen[6:]), frozen
    finally:
        os.kill(spin.pid, signal.SIGKILL)
        spin.wait()


def test_a_gone_process_has_no_cpu_time():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert process_cpu_s(p.pid) is None
