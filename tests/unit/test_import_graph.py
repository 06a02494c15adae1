"""Import circles that were broken stay broken: every import statement of the packages (at module level,
inside functions, under ``TYPE_CHECKING``) parsed with ``ast`` into a module graph, then checked.

- ``distbench``: no circle at all (``cli`` ↔ ``commands`` ↔ ``locust_cmd``/``repeat`` was one; the run
  arguments live in ``distbench/load_args.py``, which imports no subcommand).
- the engine's ops (``server/engine/ops/``): the model imports the ops, the ops never reach the model,
  and the model and the ops import one another in no circle.
- the router's HTTP layer: the route modules and what they stand on import in no circle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "distbench", "sla", "reports", "chaos", "ci", "planner")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(["distserve", *parts])] = f  # the installed name (distserve/ links each package)
    return out


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the repository modules it imports (``from a import b``: ``a.b`` when that is a module)."""
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.split(".")[0] in PACKAGES:  # un-namespaced (make lint refuses it): the same module
                    t = f"distserve.{t}"
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    g[m].add(t)
    return g


def _cycles(g: dict[str, set[str]], within: set[str]) -> list[list[str]]:
    """The strongly connected components (size > 1) of ``g`` restricted to ``within`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        for w in sorted(g[n] & within):
            if w not in index:
                visit(w)
                low[n] = min(low[n], low[w])
            elif w in stack:
                low[n] = min(low[n], index[w])
        if low[n] == index[n]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == n:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in sorted(within):
        if n not in index:
            visit(n)
    return out


def _reachable(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in g[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph(_modules())


def test_the_checker_finds_a_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g, set(g)) == [["a", "b", "c"]]
    assert _cycles(g, {"a", "b", "d"}) == []


def test_distbench_imports_in_no_circle(graph):
    distbench = {m for m in graph if m == "distbench" or m.startswith("distserve.distbench.")}
    assert {
        "distserve.distbench.cli",
        "distserve.distbench.commands",
        "distserve.distbench.locust_cmd",
        "distserve.distbench.load_args",
    } <= distbench
    assert _cycles(graph, distbench) == []
    assert "distserve.distbench.cli" not in _reachable(graph, "distserve.distbench.commands")


def test_the_model_imports_the_ops_and_the_ops_never_the_model(graph):
    ops = {m for m in graph if m.startswith("distserve.server.engine.ops.")}
    assert {"distserve.server.engine.ops.layer_ops", "distserve.server.engine.ops.cuda_ops"} <= ops
    assert "distserve.server.engine.ops.layer_ops" in graph["distserve.server.engine.model"]
    for m in sorted(ops):
        assert "distserve.server.engine.model" not in _reachable(graph, m), m
    assert _cycles(graph, ops | {"distserve.server.engine.model"}) == []
    assert not [
        m for m in graph if m in ("distserve.server.engine.layer_ops", "distserve.server.engine.cuda_ops")
    ]  # moved, not copied


def test_the_router_http_layer_imports_in_no_circle(graph):
    router = {m for m in graph if m.startswith("distserve.server.router.")}
    layer = {m for m in router if m.startswith("distserve.server.router.routes")} | {
        f"distserve.server.router.{n}"
        for n in ("app", "state", "auth", "errors", "body", "prompts", "serving", "run", "streaming")
    }
    assert layer <= set(graph)
    assert _cycles(graph, layer) == []


def test_the_moved_modules_import_alone_in_a_fresh_interpreter():
    for name in (
        "distserve.distbench.cli",
        "distserve.distbench.locust_cmd",
        "distserve.distbench.repeat",
        "distserve.server.engine.ops.layer_ops",
    ):
        r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, (name, r.stderr[-2000:])
