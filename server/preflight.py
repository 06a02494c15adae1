"""Checks ``distserve serve``/``router`` run before starting anything, so a predictable failure is one clear
sentence (exit status 2) instead of a child's traceback: a port already in use, CUDA asked for where there is
none, a model that does not exist. Also the clean-up of temporary folders that a ``kill -9``'d launcher could
not remove."""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

TMP_PREFIX = "distserve-"
SHM_PREFIX = "dskv_"  # KV segments (server/kv_transfer/shm.py): dskv_<creator pid>_<32 hex>


def port_problem(host: str, port: int) -> str | None:
    """A sentence when ``host:port`` cannot be bound now (None when free, or when port is 0 = any)."""
    if not port:
        return None
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return (
                f"port {port} on {host} is already in use (another distserve?); stop it or pick another "
                "port with --port (0 = any free port)"
            )
        return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def model_problem(model: str | None) -> str | None:
    """The sentence every worker would die with at start-up when ``model`` cannot be found (an unknown
    ``preset:``, a missing path, a folder without ``config.json``); None when it resolves. Loads nothing."""
    if model is None:  # the built-in tiny model, created on first use
        return None
    if model.startswith("preset:"):
        from distserve.server.engine.presets import preset_config

        try:
            preset_config(model)
        except ValueError as e:
            return f"--model {model}: {e}"
        return None
    from distserve.server.engine.loader import load_model_config, resolve_model_path

    try:
        load_model_config(resolve_model_path(model))  # config.json only: a field we cannot follow is refused here
    except (OSError, ValueError, ImportError) as e:
        return f"--model: {e}"
    return None


def backend_problem(backends: dict[str, str], devices: list[str]) -> str | None:
    """A sentence when a section asks for a CUDA-only attention backend and a worker runs on the CPU, or for
    flash_attn_v2 where the flash-attn package is not installed."""
    import importlib.util

    for section, name in backends.items():
        if name == "flash_attn_v2" and importlib.util.find_spec("flash_attn") is None and devices:
            if all(d.startswith("cuda") for d in devices):
                return (
                    f"{section}.attention_backend 'flash_attn_v2' needs the flash-attn package, which is not "
                    "installed: pip install -e '.[gpu]' in this checkout, or use 'auto' (Triton) instead"
                )
    if not any(not d.startswith("cuda") for d in devices):
        return None
    for section, name in backends.items():
        if name in ("flash_attn_v2", "triton"):
            return (
                f"{section}.attention_backend {name!r} needs a CUDA device and this worker runs on the CPU; "
                "use 'auto' or 'sdpa' there (or --device cuda)"
            )
    return None


def memory_problem(model: str | None, devices: list[str], num_workers: int, dtype: str = "auto") -> str | None:
    """A sentence when CPU workers would need more memory for their weights than this machine has available
    (each worker loads its own copy), so the kernel's OOM killer does not end the start-up with a bare -9."""
    if not any(not d.startswith("cuda") for d in devices):
        return None
    try:
        from distserve.server.engine.loader import load_model_config, resolve_model_path
        from distserve.server.engine.presets import is_preset, preset_config

        mc = preset_config(model) if is_preset(model) else load_model_config(resolve_model_path(model))
    except (OSError, ValueError, ImportError):
        return None  # model_problem says what is wrong with it
    available = _mem_available_bytes()
    if available is None:
        return None
    bytes_per = {"float16": 2, "bfloat16": 2}.get(dtype, 4)  # CPU workers compute in float32 unless told
    need = mc_param_count(mc) * bytes_per * num_workers
    if need <= available:
        return None
    gib = 1 << 30
    return (
        f"--model {model}: {num_workers} CPU worker(s) need about {need / gib:.1f} GiB for the weights "
        f"({mc_param_count(mc) / 1e9:.2f} B parameters x {bytes_per} bytes each, one copy per worker) and this "
        f"machine has {available / gib:.1f} GiB available; use a smaller model, fewer workers or --device cuda"
    )


def mc_param_count(mc) -> int:
    """Parameters of a Llama-family model config (embeddings, layers, head unless tied)."""
    h, kv = mc.hidden_size, mc.num_key_value_heads * mc.head_dim
    attn = h * mc.num_attention_heads * mc.head_dim * 2 + h * kv * 2
    mlp = 3 * h * mc.intermediate_size
    head = 0 if mc.tie_word_embeddings else mc.vocab_size * h
    return mc.vocab_size * h + mc.num_hidden_layers * (attn + mlp + 2 * h) + h + head


def context_warning(model: str | None, max_seq_len: int) -> str | None:
    """A sentence when ``prefill.max_seq_len`` is above the model's context (positions it was not trained on)."""
    try:
        from distserve.server.engine.loader import load_model_config, resolve_model_path
        from distserve.server.engine.presets import is_preset, preset_config

        mc = preset_config(model) if is_preset(model) else load_model_config(resolve_model_path(model))
    except (OSError, ValueError, ImportError):
        return None
    if max_seq_len <= mc.max_position_embeddings:
        return None
    return (
        f"prefill.max_seq_len {max_seq_len} is above the model's context length "
        f"(max_position_embeddings {mc.max_position_embeddings}); positions past it were never trained and "
        "the output degrades there: set prefill.max_seq_len to the context length"
    )


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_problem(devices: list[str]) -> str | None:
    """A sentence when a CUDA device is asked for and this torch/machine has none (or fewer)."""
    cuda = [d for d in devices if d.startswith("cuda")]
    if not cuda:
        return None
    import torch

    if not torch.cuda.is_available():
        build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        return f"--device {cuda[0]}: CUDA is not available ({build}); use --device cpu"
    count = torch.cuda.device_count()
    for d in cuda:
        index = int(d.split(":", 1)[1]) if ":" in d else 0
        if index >= count:
            return f"--device {d}: only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})"
    return None


def launcher_tmp_prefix() -> str:
    """Temporary folders carry the launcher's PID, so a later launcher can tell which ones are orphans."""
    return f"{TMP_PREFIX}{os.getpid()}-"


def sweep_orphan_tmp(root: str | None = None) -> list[Path]:
    """Remove ``distserve-<pid>-*`` folders whose launcher is gone (killed with SIGKILL); return them."""
    removed = []
    for p in Path(root or tempfile.gettempdir()).glob(f"{TMP_PREFIX}*-*"):
        pid_text = p.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or not p.is_dir() or p.owner() != _me():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        except PermissionError:
            pass  # alive, someone else's
    return removed


def _me() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def sweep_orphan_segments(prefix: str = SHM_PREFIX, root: str = "/dev/shm") -> list[str]:
    """Unlink this user's KV segments whose creating process is gone; the names unlinked.

    A sender's segments are unlinked by the sender, or by its resource tracker when it dies; when both
    die together (SIGKILL of the process group) they stay in /dev/shm until reboot. Each name carries
    its creator's pid, so the next start (the launcher, a prefill worker) removes the ones whose creator
    no longer exists. Only segments owned by the running user; a pid that exists (alive, or reused by
    another process) keeps its segments: never remove what might be in use."""
    pattern = re.compile(re.escape(prefix) + r"([0-9]{1,10})_[0-9a-f]{32}")
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        try:
            if os.lstat(os.path.join(root, name)).st_uid != os.geteuid():
                continue
            os.kill(int(m.group(1)), 0)
            continue  # the creator (or a process with its pid) lives
        except ProcessLookupError:
            pass
        except OSError:  # gone already, or the pid is someone else's process: leave it
            continue
        try:
            os.unlink(os.path.join(root, name))
            removed.append(name)
        except OSError:
            pass
    return removed
