"""Put every reference to the project's packages under the one ``distserve`` namespace.

The packages stay top-level folders of the checkout (``server/``, ``distbench/``, ``chaos/``, ``sla/``,
``reports/``, ``configs/``, ``ci/``, ``planner/``); ``distserve/`` holds a relative symlink to each, and the
wheel installs them as ``distserve.server`` ... so a user's environment gains one import name. Code must
therefore name them ``distserve.server.x``; ``server.x`` would import a second copy of the module from the
checkout (and fail when installed). This script rewrites, in every tracked or new text file:

- import statements: ``from server.x import y`` -> ``from distserve.server.x import y``;
  ``import server.x as m`` -> ``import distserve.server.x as m``; ``import os, server.x`` ->
  ``import os`` + ``import distserve.server.x`` + ``from distserve import server`` (the name stays bound);
  also inside strings of code (``python -c "from server.cli import main"``);
- module names in strings: ``"server.cli"``, ``f"chaos.injectors.{name}"``, ``"server." + x``,
  ``"server.cli:main"`` (entry points), ``"server.workers.heartbeat"`` (logger names, patch targets), when
  the first part after the package is a module or package that exists in the tree (``"distbench.json"`` is a
  file name and stays);
- ``-m`` arguments: ``python -m server.cli``, ``"-m", "distbench"``, ``-m, server.cli`` (YAML argv lists), and
  YAML ``...module: server.workers.fault`` values (a bare package only when it has a ``__main__.py``, so
  ``pytest -m chaos`` stays).

Idempotent: a rewritten reference starts with ``distserve.`` and matches nothing. Changed Python files then
get ``ruff check --select I --fix`` and ``ruff format`` (the longer names re-sort and re-wrap).

    python ci/namespace_rewrite.py           # rewrite the tree, list what changed
    python ci/namespace_rewrite.py --check   # exit 1 naming each un-namespaced reference (make lint runs it)
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

NAMESPACE = "distserve"
PACKAGES = ("server", "distbench", "chaos", "sla", "reports", "configs", "ci", "planner")
ROOT = Path(__file__).resolve().parents[1]

# Files whose text must keep the old spellings: this script and its test (their examples), and the
# verbatim records (the performance pages: commands as they were run).
SKIP = {"ci/namespace_rewrite.py", "tests/unit/test_namespace_rewrite.py", "docs/PERFORMANCE.md"}
SKIP_UNDER = ("docs/performance/", "bench/baselines/", "bench/records/", "bench/results/", ".venv/", "build/")
SUFFIXES = {".py", ".pyi", ".toml", ".yaml", ".yml", ".sh", ".md", ".cfg", ".ini", ".txt"}
JSON_UNDER = ("configs/",)  # JSON elsewhere is recorded data (commands as they ran), not read as code

_NAMES = "|".join(PACKAGES)
_FROM = re.compile(rf"(?<![\w.])from(\s+)({_NAMES})((?:\.\w+)*)(\s+import\b)")
# an import statement at the start of a line, after `;`, or at the start of a string of code
_IMPORT = re.compile(
    r"(?P<lead>^[ \t]*|;[ \t]*|(?<=[\"']))import[ \t]+"
    r"(?P<names>[\w.]+(?:[ \t]+as[ \t]+\w+)?(?:[ \t]*,[ \t]*[\w.]+(?:[ \t]+as[ \t]+\w+)?)*)"
    r"(?=[ \t]*(?:$|;|#|[\"']|\\n))",  # the whole statement (a continued line is left to the parser's check)
    re.MULTILINE,
)
_QUOTED = re.compile(rf"(?<=[\"'])({_NAMES})((?:\.\w+)*)(\.?)(?=([\"'{{:]))")
_DASH_M = re.compile(rf"(?<![\w-])-m(?P<sep>[\"']?[ \t]*,?\s*[\"']?)(?P<mod>(?:{_NAMES})(?:\.\w+)*)(?![\w./-])")
_YAML_MODULE = re.compile(rf"(?P<key>\b\w*module\w*:[ \t]*)(?P<mod>(?:{_NAMES})(?:\.\w+)+)(?![\w./-])")


def _real(mod: str, root: Path = ROOT) -> bool:
    """``server.cli`` names a module of the tree (its first part after the package exists)."""
    parts = mod.split(".")
    if len(parts) == 1:
        return (root / parts[0] / "__main__.py").is_file()
    base = root / parts[0] / parts[1]
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _rewrite_import(m: re.Match, root: Path) -> str:
    entries = [e.strip() for e in m["names"].split(",")]
    if not any(e.split()[0].split(".")[0] in PACKAGES for e in entries):
        return m[0]
    keep, extra = [], []
    for e in entries:
        mod, _, alias = e.partition(" as ")
        mod, alias = mod.strip(), alias.strip()
        top = mod.split(".")[0]
        if top not in PACKAGES:
            keep.append(e)
        elif alias:
            keep.append(f"{NAMESPACE}.{mod} as {alias}")
        elif mod == top:
            extra.append(f"from {NAMESPACE} import {top}")
        else:  # `import server.x` binds `server` with `.x` loaded: the same, under the namespace
            keep.append(f"{NAMESPACE}.{mod}")
            extra.append(f"from {NAMESPACE} import {top}")
    lead = m["lead"]
    stmts = ([f"import {', '.join(keep)}"] if keep else []) + list(dict.fromkeys(extra))
    if lead.strip() == "" and (m.start() == 0 or m.string[m.start() - 1] == "\n"):
        return lead + ("\n" + lead).join(stmts)  # a statement of its own: one per line, same indentation
    return lead + "; ".join(stmts)  # inside a line of code (a string for `python -c`)


def rewrite(text: str, suffix: str, root: Path = ROOT) -> str:
    """``text`` with every reference to the packages put under the namespace (see the module docstring)."""
    if suffix in (".py", ".pyi", ".md"):
        text = _FROM.sub(lambda m: f"from{m[1]}{NAMESPACE}.{m[2]}{m[3]}{m[4]}", text)
        text = _IMPORT.sub(lambda m: _rewrite_import(m, root), text)

    def quoted(m: re.Match) -> str:
        mod, rest, dot, nxt = m[1], m[2], m[3], m[4]
        end = m.end()
        if nxt == ":":  # an entry point, `server.cli:main"`
            if not rest or not re.match(r":[\w.]+[\"']", m.string[end:]):
                return m[0]
        elif nxt == "{" and not dot:
            return m[0]
        elif nxt in "\"'" and not rest and not dot:
            return m[0]  # the bare word "server" is a word, not a module
        if rest and not _real(mod + rest, root):
            return m[0]
        return f"{NAMESPACE}.{m[0]}"

    text = _QUOTED.sub(quoted, text)
    text = _DASH_M.sub(lambda m: f"-m{m['sep']}{NAMESPACE}.{m['mod']}" if _real(m["mod"], root) else m[0], text)
    if suffix in (".yaml", ".yml"):
        text = _YAML_MODULE.sub(lambda m: f"{m['key']}{NAMESPACE}.{m['mod']}" if _real(m["mod"], root) else m[0], text)
    return text


def leftover_imports(text: str) -> list[int]:
    """Lines of absolute import statements that still name a package at the top level, by the parser: the
    safety net under the patterns above (a form they do not know is reported, not silently kept)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n.split(".")[0] in PACKAGES for n in names):
            out.append(node.lineno)
    return out


def files(root: Path = ROOT) -> list[Path]:
    """Tracked and new (not ignored) text files of the checkout that may name the packages."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = sorted({n for n in out.split("\0") if n})
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk it (symlinks not followed)
        names = sorted(
            str((Path(d) / f).relative_to(root)) for d, _, fs in os.walk(root, followlinks=False) for f in fs
        )
    picked = []
    for n in names:
        p = root / n
        if n in SKIP or n.startswith(SKIP_UNDER) or p.is_symlink() or not p.is_file():
            continue
        if p.suffix in SUFFIXES or n == "Makefile" or (p.suffix == ".json" and n.startswith(JSON_UNDER)):
            picked.append(p)
    return picked


def _ruff(paths: list[Path], root: Path, say: Callable[[str], None]) -> None:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if not exe:
        say("ruff not found: run `ruff check --select I --fix` and `ruff format` on the files above")
        return
    args = [str(p) for p in paths]
    subprocess.run([exe, "check", "--quiet", "--select", "I", "--fix", *args], cwd=root, check=False)
    subprocess.run([exe, "format", "--quiet", *args], cwd=root, check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each un-namespaced reference")
    ap.add_argument("--root", default=str(ROOT), help="the checkout (default: the one this script is in)")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    changed: list[Path] = []
    unknown: list[str] = []
    for p in files(root):
        try:
            old = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        new = rewrite(old, p.suffix, root)
        if p.suffix == ".py":
            lines = new.splitlines()
            unknown += [f"{p.relative_to(root)}:{n}: {lines[n - 1].strip()[:120]}" for n in leftover_imports(new)]
        if new == old:
            continue
        changed.append(p)
        rel = p.relative_to(root)
        if args.check:
            new_lines = new.splitlines()
            for i, line in enumerate(old.splitlines(), 1):
                if i > len(new_lines) or new_lines[i - 1] != line:
                    print(f"{rel}:{i}: not under `{NAMESPACE}.`: {line.strip()[:120]}")
                    break
        else:
            p.write_text(new, encoding="utf-8")
            print(f"rewrote {rel}")
    for line in unknown:
        print(f"{line}: an import of a package outside `{NAMESPACE}.` that this script cannot rewrite: fix it by hand")
    if args.check:
        if unknown and not changed:
            return 1
        if changed:
            print(
                f"namespace check: {len(changed)} file(s) name the packages outside `{NAMESPACE}.` "
                "(run `python ci/namespace_rewrite.py` to fix them)",
                file=sys.stderr,
            )
            return 1
        return 0
    py = [p for p in changed if p.suffix in (".py", ".pyi")]
    if py:
        _ruff(py, root, print)
    print(f"namespace rewrite: {len(changed)} file(s) changed")
    return 1 if unknown else 0


if __name__ == "__main__":
    sys.exit(main())
