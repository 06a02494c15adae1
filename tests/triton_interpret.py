"""Running Triton kernels on a CPU in Triton's interpreter, for the tests that check GPU kernels here.

``TRITON_INTERPRET=1`` is read when a kernel is defined, so the code runs in a subprocess with it set and the
repository on its path. ``require_interpreter()`` skips the calling test where the ``triton`` package is
absent (CI's CPU torch has none) or its interpreter does not run a trivial kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import os, torch, triton, triton.language as tl
@triton.jit
def k(p, n):
    for i in range(0, n, 1):
        tl.store(p + i, i)
t = torch.zeros(4, dtype=torch.int32)
k[(1,)](t, 4)
assert t.tolist() == [0, 1, 2, 3]
"""


def run_python(code: str, interpret: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    """``code`` (dedented) in a fresh interpreter at the repository root; ``TRITON_INTERPRET=1`` unless
    ``interpret`` is False (then it is removed from the environment: an ahead-of-time compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def require_interpreter() -> None:
    pytest.importorskip("triton")
    probe = run_python(PROBE, timeout=300)
    if probe.returncode != 0:
        pytest.skip("Triton's interpreter does not run here: " + probe.stderr.strip().splitlines()[-1][:200])
