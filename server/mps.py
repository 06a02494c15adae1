"""SM partitions for workers that share one GPU: a CUDA MPS control daemon of the launcher's own.

``distserve serve --devices cuda:0 --prefill 1 --decode 1 --sm-split 60:40`` (or ``prefill.sm_share`` /
``decode.sm_share``) runs every worker of a split GPU as an MPS client with
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` set to its role's share: a prefill step can then take at most its
part of the SMs, and decode steps — bandwidth-bound, so a minority of the SMs gives them most of the
memory bandwidth — keep theirs. Each worker's device memory is capped too
(``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, from its memory share).

The daemon is the launcher's: its pipe and log folders live in a private 0700 folder
(``<tmp>/distserve-mps-<launcher pid>-*``), so it never meets another user's daemon, and nothing outside
that folder is touched (no MIG, no device settings, no ``nvidia-smi -c``). A daemon already listening
at ``$CUDA_MPS_PIPE_DIRECTORY`` is joined instead, and left running at the end. The launcher stops the
daemon it started with ``quit`` at shutdown; a launcher killed with SIGKILL leaves its daemon behind,
and the next launcher finds the folder (its pid is gone), sends that daemon ``quit`` and removes it.
Where MPS cannot run (no ``nvidia-cuda-mps-control`` on the PATH, or the daemon does not start),
:class:`MpsUnavailable` says so in one sentence and ``serve`` exits 2.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PREFIX = "distserve-mps-"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
THREADS_ENV, MEM_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
# allowed on top of a worker's memory share in its pinned limit for what the CUDA context holds; the worker
# sizes inside its limit less this (memory_profile: the process limit)
CONTEXT_MIB = 1024


class MpsUnavailable(RuntimeError):
    """MPS cannot partition this GPU here; the message is one sentence."""


def parse_sm_split(text: str) -> tuple[int, int]:
    """'60:40' -> (60, 40): the prefill and decode workers' percentages of the SMs; ValueError otherwise."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--sm-split must be PREFILL:DECODE percentages like 60:40, got {text!r}")
    pf, dc = (int(p) for p in parts)
    if not (1 <= pf <= 100 and 1 <= dc <= 100):
        raise ValueError(f"--sm-split percentages must be in 1..100, got {text!r}")
    return pf, dc


def worker_env(mps_dir: Path, percentage: int, mem_limit_mib: int | None = None, device_index: int = 0) -> dict:
    """The environment of one MPS client worker."""
    env = {PIPE_ENV: str(mps_dir / "pipe"), LOG_ENV: str(mps_dir / "log"), THREADS_ENV: str(percentage)}
    if mem_limit_mib:
        env[MEM_ENV] = f"{device_index}={mem_limit_mib}M"
    return env


def _owned_private_dir(p: Path) -> bool:
    try:
        st = p.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _quit(pipe_dir: Path, log_dir: Path, timeout_s: float = 10.0) -> bool:
    env = dict(os.environ, **{PIPE_ENV: str(pipe_dir), LOG_ENV: str(log_dir)})
    try:
        p = subprocess.run(
            [CONTROL], input="quit\n", env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0


def sweep_stale_daemons(root: str | None = None) -> list[Path]:
    """Folders of launchers that are gone (SIGKILL): ``quit`` to their daemon, then remove them. Only
    0700 folders of this user are considered (never state another user could write)."""
    cleaned = []
    for p in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid_text = p.name[len(PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or not _owned_private_dir(p) or _alive(int(pid_text)):
            continue
        if (p / "pipe").is_dir() and shutil.which(CONTROL):
            _quit(p / "pipe", p / "log")
        shutil.rmtree(p, ignore_errors=True)
        cleaned.append(p)
    return cleaned


@dataclass
class MpsDaemon:
    """The launcher's MPS control daemon (started, or joined)."""

    root: str | None = None  # where the private folder goes (default: the temp folder)
    start_timeout_s: float = 10.0
    folder: Path | None = None
    started: bool = False  # True: ours to stop
    events: list[str] = field(default_factory=list)

    def start(self) -> MpsDaemon:
        if shutil.which(CONTROL) is None:
            raise MpsUnavailable(
                f"--sm-split needs CUDA MPS, and {CONTROL} is not on the PATH (install the NVIDIA driver's "
                "MPS tools, or leave --sm-split out to share the GPU unpartitioned)"
            )
        for stale in sweep_stale_daemons(self.root):
            self.events.append(f"stopped the MPS daemon of a launcher that is gone ({stale})")
        joined = os.environ.get(PIPE_ENV)
        if joined and (Path(joined) / "control").exists():
            self.folder = Path(joined).parent
            self.pipe_dir, self.log_dir = Path(joined), Path(os.environ.get(LOG_ENV, joined))
            self.events.append(f"joined the MPS daemon at {joined}")
            return self
        self.folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.root))  # 0700
        self.pipe_dir, self.log_dir = self.folder / "pipe", self.folder / "log"
        self.pipe_dir.mkdir(mode=0o700)
        self.log_dir.mkdir(mode=0o700)
        env = dict(os.environ, **{PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)})
        try:
            p = subprocess.run(
                [CONTROL, "-d"], env=env, capture_output=True, text=True, timeout=self.start_timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            self._remove()
            raise MpsUnavailable(f"the CUDA MPS control daemon did not start ({e})") from None
        if p.returncode != 0:
            self._remove()
            why = (p.stderr or p.stdout).strip().splitlines()
            raise MpsUnavailable(
                f"the CUDA MPS control daemon did not start (exit {p.returncode}"
                + (f": {why[-1][:200]}" if why else "")
                + "); leave --sm-split out to share the GPU unpartitioned"
            )
        self.started = True
        deadline = time.monotonic() + self.start_timeout_s
        while not (self.pipe_dir / "control").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.events.append(f"started an MPS control daemon (pipe {self.pipe_dir})")
        return self

    def env(self, percentage: int, mem_limit_mib: int | None = None, device_index: int = 0) -> dict:
        assert self.folder is not None, "start() first"
        env = worker_env(self.folder, percentage, mem_limit_mib, device_index)
        env[PIPE_ENV], env[LOG_ENV] = str(self.pipe_dir), str(self.log_dir)
        return env

    def stop(self) -> None:
        """``quit`` to the daemon we started (after its clients exited), then remove its folder."""
        if self.started and self.folder is not None:
            ok = _quit(self.pipe_dir, self.log_dir)
            self.events.append("stopped the MPS control daemon" if ok else "the MPS daemon did not answer quit")
            self.started = False
            self._remove()

    def _remove(self) -> None:
        if self.folder is not None and self.folder.name.startswith(PREFIX):
            shutil.rmtree(self.folder, ignore_errors=True)


def device_sm_count(index: int, timeout_s: float = 60.0) -> int | None:
    """The GPU's SM count outside MPS (a short child process: the launcher never initialises CUDA)."""
    code = f"import torch; print(torch.cuda.get_device_properties({index}).multi_processor_count)"
    env = {k: v for k, v in os.environ.items() if k not in (PIPE_ENV, THREADS_ENV, MEM_ENV)}
    try:
        p = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        return int(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def expected_sms(total_sms: int, percentage: int) -> int:
    """SMs a client at ``percentage`` may use (MPS rounds up to whole SMs)."""
    return max(1, -(-total_sms * percentage // 100))


def gemm_self_check(
    device,
    hidden: int = 4096,
    out_features: int = 12288,
    rows: tuple[int, ...] = (1, 8, 64, 128, 256),
    reps: int = 4,
    matmul=None,
) -> str | None:
    """Under MPS, a check that this SM share computes right: bf16 GEMMs of the model's hidden size (``rows``
    x ``hidden`` times ``hidden`` x ``out_features``), each ``reps`` times, against a float64 product of the
    same inputs. None when every result is finite and within bf16's rounding; else one sentence naming the
    shape, the share and how many values were wrong. (On an H200, torch 2.11 + cu130: at 40 % of the SMs a
    bf16 GEMM of 128 x 4096 x 12288 returned NaN/Inf, at 45 % decode tokens differed between graphs and
    eager, at 50 % and without MPS both were right: a share is checked, never assumed.)"""
    import torch

    mm = matmul or (lambda a, b: a @ b)
    g = torch.Generator(device="cpu").manual_seed(1234)
    w = (torch.randn(hidden, out_features, generator=g) / hidden**0.5).to(device, torch.bfloat16)
    for m in rows:
        x = torch.randn(m, hidden, generator=g).to(device, torch.bfloat16)
        ref = x.double() @ w.double()
        tol = 0.05 + 0.02 * ref.abs()
        for _ in range(reps):
            y = mm(x, w).double()
            bad = ~torch.isfinite(y) | ((y - ref).abs() > tol)
            n_bad = int(bad.sum())
            if n_bad:
                n_nonfinite = int((~torch.isfinite(y)).sum())
                pct = os.environ.get(THREADS_ENV, "100")
                return (
                    f"a bf16 GEMM of {m} x {hidden} by {hidden} x {out_features} on this process's share of the "
                    f"GPU ({pct} % of the SMs) gave {n_bad} wrong values of {y.numel()} ({n_nonfinite} NaN/Inf): "
                    "this share computes wrong results with this driver and library; choose another --sm-split "
                    "(50:50 was right on an H200) or serve without one"
                )
    del w
    return None


def probe(device, total_sms: int | None = None) -> dict | None:
    """At worker start, under MPS: the thread percentage asked for, the SM count the device reports to
    this process, whether that is the split asked for, and a bf16 GEMM rate (a measured check that the
    partition holds: about the share of the full GPU's rate). None when this process is no MPS client."""
    pct = os.environ.get(THREADS_ENV)
    if pct is None:
        return None
    import torch

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n = 4096
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 20
    for _ in range(reps):
        a @ a
    end.record()
    end.synchronize()
    tflops = 2 * n**3 * reps / (start.elapsed_time(end) / 1000) / 1e12
    del a
    torch.cuda.empty_cache()  # after the KV sizing: give the probe's matrices back
    out = {"thread_percentage": int(pct), "sm_count": sms, "gemm_bf16_tflops": round(tflops, 1)}
    if total_sms:
        out["device_sm_count"] = total_sms
        out["split_in_effect"] = sms <= expected_sms(total_sms, int(pct)) < total_sms or int(pct) == 100
    return out
