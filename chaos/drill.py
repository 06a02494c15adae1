"""`distserve chaos drill FILE`: steady state → faults under distbench load → invariants → rollback.

The drill file follows Chaos Toolkit's experiment shape (title, description,
``steady-state-hypothesis`` of probes with tolerances, ``method``, ``rollbacks``)
plus ``target`` (a deployment to start here, or a URL), ``load`` (distbench run
as a subprocess) and ``invariants``. Rollback always runs — on success, failure,
exception, Ctrl-C and SIGTERM — in reverse order of injection, then the target is
stopped; the journal (JSON) and report (Markdown) are written atomically.
Exit status: 0 completed, 1 failed (an invariant or the hypothesis), 3 aborted,
130 interrupted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from distserve.chaos import injectors
from distserve.chaos import state as chaos_state
from distserve.chaos.invariants import (
    breaker_invariant,
    kv_blocks_invariant,
    objective_invariants,
    requests_invariant,
    state_invariant,
    summarize,
)
from distserve.chaos.journal import Journal, write
from distserve.chaos.probes import run_probe
from distserve.chaos.target import Target
from distserve.chaos.workers import list_workers
from distserve.configs import find as find_config

EXIT = {"completed": 0, "failed": 1, "aborted": 3, "interrupted": 130}
TOP_KEYS = {
    "title",
    "description",
    "incident",
    "target",
    "steady-state-hypothesis",
    "load",
    "method",
    "rollbacks",
    "invariants",
    "tags",
}


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM: stop the method, roll back, write the journal."""


def load_drill(path: str) -> dict:
    with open(find_config(path)) as f:
        d = yaml.safe_load(f)
    if not isinstance(d, dict):
        raise TypeError(f"{path}: a drill is a YAML mapping")
    unknown = set(d) - TOP_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(TOP_KEYS))}")
    for i, step in enumerate(d.get("method") or []):
        if step.get("type") == "action" and "injector" in step:
            injectors.get(step["injector"])  # ValueError naming the unknown one
        elif step.get("type") not in ("action", "probe", "sleep", "join", "leave", "restart"):
            raise ValueError(f"{path}: method[{i}].type must be action, probe, sleep, join, leave or restart")
    return d


def _fill(value, ctx: dict):
    """Replace {router}, {netns}, ... in strings (only known names: braces elsewhere stay)."""
    if isinstance(value, str):
        whole = re.fullmatch(r"\{(\w+)\}", value)
        if whole and whole.group(1) in ctx:
            return ctx[whole.group(1)]
        return re.sub(r"\{(\w+)\}", lambda m: str(ctx[m.group(1)]) if m.group(1) in ctx else m.group(0), value)
    if isinstance(value, dict):
        return {k: _fill(v, ctx) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, ctx) for v in value]
    return value


class LoadRun:
    """distbench run as a subprocess (its CLI is the contract); the result file's ``requests`` list."""

    def __init__(self, spec: dict, url: str, out_dir: Path) -> None:
        self.spec, self.result = spec, out_dir / "distbench.json"
        self.timeout_s = float(spec.get("timeout_s", 300))
        argv = [
            sys.executable,
            "-m",
            "distserve.distbench.cli",
            "run",
            "--url",
            url,
            "--concurrency",
            str(spec.get("concurrency", 4)),
            "--num-prompts",
            str(spec.get("num_prompts", 32)),
            "--prompt-len",
            str(spec.get("prompt_len", 64)),
            "--output-len",
            str(spec.get("output_len", 32)),
            "--seed",
            str(spec.get("seed", 0)),
            "--save-result",
            str(self.result),
        ]
        if spec.get("duration_s"):
            argv += ["--duration", str(spec["duration_s"])]
            # requests in flight at the end may finish within the drill's own timeout (distbench's default
            # drain is 30 s; a drill's fault can hold requests longer, and they must not read as cancelled)
            argv += ["--drain-timeout", str(self.timeout_s)]
        self.log = open(out_dir / "distbench.log", "wb")  # noqa: SIM115 - open while the subprocess runs
        self.argv = [str(a) for a in argv]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()

    def finish(self) -> dict:
        out: dict = {"timeout_s": self.timeout_s, "argv": " ".join(self.argv[3:])}
        try:
            self.proc.wait(max(1.0, self.timeout_s - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.kill()
            out["hung"] = True
        finally:
            self.log.close()
        out["exit_code"] = self.proc.returncode
        try:
            records = json.loads(self.result.read_text())["requests"]
            out["summary"] = summarize(records, float(self.spec.get("request_timeout_s", self.timeout_s)))
        except (OSError, ValueError, KeyError) as e:
            out.setdefault("error", f"no distbench result: {e}")
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _do_action(step: dict, ctx: dict, target: Target, undo: list) -> dict:
    kind = step["type"]
    args = _fill(step.get("arguments") or {}, ctx)
    if kind == "sleep":
        time.sleep(float(step.get("seconds", 1)))
        return {}
    if kind == "probe":
        return run_probe(_fill(step["probe"], ctx), ctx["router"], ctx["token"])
    if kind == "join":
        wid = target.add_worker(args.get("role", "decode"))
        n = sum(1 for _ in list_workers(ctx["router"], ctx["token"])) + 1
        target.wait_workers(n, time.monotonic() + float(args.get("timeout_s", 120)))
        ctx["joined"] = wid
        return {"mechanism": "hot join: a new worker registers mid-load", "worker_id": wid}
    if kind == "restart":  # a supervisor's job: the killed worker comes back under the same id
        wid = args["worker_id"]
        target.restart_worker(wid)
        target.wait_workers(int(args.get("expect_healthy", 1)), time.monotonic() + float(args.get("timeout_s", 120)))
        return {"mechanism": "restart by the drill's target (supervision)", "worker_id": wid}
    if kind == "leave":
        leaving = args.get("worker_id") or ctx.get("joined")
        if not leaving:
            raise ValueError("a 'leave' step needs worker_id, or a worker joined earlier in the drill")
        code = target.stop_worker(str(leaving))
        return {"mechanism": "graceful leave: SIGTERM, the worker deregisters", "worker_id": leaving, "exit_code": code}
    mod = injectors.get(step["injector"])
    args.setdefault("router_url", ctx["router"])
    args.setdefault("token", ctx["token"])
    if step.get("call") == "rollback":  # an explicit end of a fault inside the method
        undo[:] = [u for u in undo if u[1] is not mod or u[2] != args]
        return mod.rollback(**args)
    undo.append((step["name"], mod, args))  # before inject: a half-done injection is still rolled back
    return mod.inject(**args)


def _rollback_all(undo: list, journal: Journal) -> None:
    while undo:
        name, mod, args = undo.pop()
        try:
            journal.record("rollbacks", {"name": name, "status": "succeeded", "output": mod.rollback(**args)})
        except Exception as e:  # noqa: BLE001 - keep undoing the rest
            journal.record("rollbacks", {"name": name, "status": "failed", "error": f"{type(e).__name__}: {e}"})


def run_drill(path: str, out_dir: Path | None = None, url: str | None = None) -> tuple[Journal, Path]:
    """Run one drill; ``url`` points it at a running deployment instead of the file's local target
    (admin token from $DISTSERVE_ADMIN_TOKEN)."""
    spec = load_drill(path)
    if url:
        spec["target"] = {"url": url}
    name = Path(path).stem
    out_dir = out_dir or Path(tempfile.mkdtemp(prefix=f"drill-{name}-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    journal = Journal(drill=name, title=spec.get("title", name), incident=spec.get("incident", ""))
    target = Target(spec.get("target") or {}, out_dir / "logs")
    undo: list = []
    load: LoadRun | None = None
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum, frame):
        # once: a second Ctrl-C must not cut the rollback short
        for sig in previous:
            signal.signal(sig, lambda *_: None)
        raise Interrupted(signal.Signals(signum).name)

    if threading.current_thread() is threading.main_thread():
        for s in previous:
            signal.signal(s, on_signal)
    status = "aborted"
    # this drill's injector state, in a sub-folder of the user's private state folder: "all rolled back"
    # is checkable, and `distserve chaos rollback --all` finds it if this process is killed
    state_dir = chaos_state.state_root() / "drills" / f"{out_dir.name}-{os.getpid()}"
    old_state_env = os.environ.get(chaos_state.ENV)
    os.environ[chaos_state.ENV] = str(state_dir)
    try:
        target.start()
        ctx = target.context()
        journal.target = {k: v for k, v in ctx.items() if k != "token"}
        alive: dict[str, list[int]] = {}
        for w in list_workers(ctx["router"], ctx["token"]):
            alive.setdefault(w["role"], []).append(int(w["pid"]))
        hyp = spec.get("steady-state-hypothesis") or {}
        for p in hyp.get("probes", []):
            journal.steady_state_before.append(run_probe(_fill(p, ctx), ctx["router"], ctx["token"]))
        if not all(p["ok"] for p in journal.steady_state_before):
            status = "failed"
            journal.error = "steady state deviated before any fault: the drill did not inject"
            return journal, out_dir
        if spec.get("load"):
            load = LoadRun(spec["load"], ctx["router"], out_dir)
        for step in spec.get("method") or []:
            time.sleep(float((step.get("pauses") or {}).get("before", 0)))
            entry = {"name": step.get("name", step["type"]), "type": step["type"], "status": "succeeded"}
            try:
                entry["output"] = _do_action(step, ctx, target, undo)
            except Exception as e:
                entry.update(status="failed", error=f"{type(e).__name__}: {e}")
                journal.record("run", entry)
                raise
            journal.record("run", entry)
            time.sleep(float((step.get("pauses") or {}).get("after", 0)))
        if load is not None:
            journal.load = load.finish()
            load = None
        _rollback_all(undo, journal)
        inv = spec.get("invariants") or {}
        journal.invariants.append(requests_invariant(journal.load))
        journal.invariants.append(
            kv_blocks_invariant(ctx["router"], ctx["token"], float(inv.get("kv_blocks_within_s", 30)))
        )
        journal.invariants.append(breaker_invariant(ctx["router"], float(inv.get("breaker_within_s", 60))))
        keep = (f"netns--{target.netns['netns']}.json",) if target.netns else ()
        journal.invariants.append(state_invariant(state_dir, keep))
        for r in journal.run:  # a probe inside the method with a tolerance is a claim about the fault
            if r["type"] == "probe" and isinstance(r.get("output"), dict) and r["output"].get("tolerance") is not None:
                journal.invariants.append(
                    {
                        "name": f"during the fault: {r['name']}",
                        "status": "passed" if r["output"]["ok"] else "failed",
                        "detail": f"value {r['output']['value']!r}, tolerance {r['output']['tolerance']!r}",
                    }
                )
        journal.invariants += objective_invariants(
            _fill(inv.get("objective") or {}, ctx), journal.load, journal.run, ctx["router"], ctx["token"], alive
        )
        settle = 0 if journal.failed_invariants() else 30  # already failed: one look, no waiting
        for p in hyp.get("probes", []):
            journal.steady_state_after.append(
                run_probe(_fill({**p, "within_s": p.get("within_s", settle)}, ctx), ctx["router"], ctx["token"])
            )
        bad = journal.failed_invariants() or not all(p["ok"] for p in journal.steady_state_after)
        status = "failed" if bad else "completed"
    except Interrupted as e:
        status, journal.error = "interrupted", f"interrupted by {e}"
    except Exception as e:  # noqa: BLE001 - any failure of the drill itself is "aborted", then rollback
        status, journal.error = "aborted", f"{type(e).__name__}: {e}"
    finally:
        try:
            if load is not None:
                load.kill()
            _rollback_all(undo, journal)
            target.stop()
        finally:
            try:
                state_dir.rmdir()  # empty once everything was rolled back; else kept for rollback --all
            except OSError:
                pass
            if old_state_env is None:
                os.environ.pop(chaos_state.ENV, None)
            else:
                os.environ[chaos_state.ENV] = old_state_env
            for s, h in previous.items():
                if threading.current_thread() is threading.main_thread():
                    signal.signal(s, h)
            journal.finish(status)
            write(journal, out_dir)
    return journal, out_dir
