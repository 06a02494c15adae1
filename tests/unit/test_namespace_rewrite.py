"""ci/namespace_rewrite.py: every way the tree names a package comes out under ``distserve.``, what is not a
module name stays, a second run changes nothing, and ``--check`` (make lint) refuses an un-namespaced import.

This file keeps the old spellings in its examples: the script skips it (``SKIP``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distserve.ci import namespace_rewrite as nr

ROOT = Path(__file__).resolve().parents[2]

# (text, suffix, expected): the references the tree holds today, one kind per row
CASES = [
    ("from server.engine.model import X\n", ".py", "from distserve.server.engine.model import X\n"),
    ("    from sla import spec as s\n", ".py", "    from distserve.sla import spec as s\n"),
    ("from configs import find\n", ".py", "from distserve.configs import find\n"),
    ("from . import x\nfrom .wire import Y\n", ".py", "from . import x\nfrom .wire import Y\n"),
    ("import server.cli as c\n", ".py", "import distserve.server.cli as c\n"),
    ("import server\n", ".py", "from distserve import server\n"),
    # the name `server` stays bound, with `.cli` loaded, as the plain import did
    ("    import os, server.cli\n", ".py", "    import os, distserve.server.cli\n    from distserve import server\n"),
    ("import os, sys\n", ".py", "import os, sys\n"),
    # code in strings (python -c)
    (
        'code = "import sys; import server.cli; server.cli.main()"\n',
        ".py",
        'code = "import sys; import distserve.server.cli; from distserve import server; server.cli.main()"\n',
    ),
    (
        'code = "from chaos import state; state.save()"\n',
        ".py",
        'code = "from distserve.chaos import state; state.save()"\n',
    ),
    # module names in strings
    (
        '[sys.executable, "-m", "server.cli", "serve"]\n',
        ".py",
        '[sys.executable, "-m", "distserve.server.cli", "serve"]\n',
    ),
    ('[sys.executable, "-m", "distbench", "run"]\n', ".py", '[sys.executable, "-m", "distserve.distbench", "run"]\n'),
    ('[\n    "-m",\n    "distbench",\n]\n', ".py", '[\n    "-m",\n    "distserve.distbench",\n]\n'),
    (
        'importlib.import_module(f"chaos.injectors.{name}")\n',
        ".py",
        'importlib.import_module(f"distserve.chaos.injectors.{name}")\n',
    ),
    ('importlib.import_module("server." + name)\n', ".py", 'importlib.import_module("distserve.server." + name)\n'),
    ('distserve = "server.cli:main"\n', ".toml", 'distserve = "distserve.server.cli:main"\n'),
    (
        'caplog.at_level(logging.WARNING, logger="server.config")\n',
        ".py",
        'caplog.at_level(logging.WARNING, logger="distserve.server.config")\n',
    ),
    (
        'monkeypatch.setattr("server.launcher.device_sm_count", f)\n',
        ".py",
        'monkeypatch.setattr("distserve.server.launcher.device_sm_count", f)\n',
    ),
    ("b'chaos.proxy' in cmdline\n", ".py", "b'distserve.chaos.proxy' in cmdline\n"),
    # not module names: file names, words, messages, pytest markers
    ('out / "distbench.json"\n', ".py", 'out / "distbench.json"\n'),
    ('sub.add_parser("sla")\n', ".py", 'sub.add_parser("sla")\n'),
    ('print(f"chaos.proxy: error: {e}")\n', ".py", 'print(f"chaos.proxy: error: {e}")\n'),
    ('"server.nosuchmodule"\n', ".py", '"server.nosuchmodule"\n'),
    ("pytest -q -m chaos tests/chaos\n", ".md", "pytest -q -m chaos tests/chaos\n"),
    ("# we import server.cli lazily\n", ".py", "# we import server.cli lazily\n"),
    # YAML argv lists, module keys, shell and docs
    ('argv: ["{python}", -m, server.cli, doctor]\n', ".yaml", 'argv: ["{python}", -m, distserve.server.cli, doctor]\n'),
    (
        "needs_module: server.workers.fault, quick: false}\n",
        ".yaml",
        "needs_module: distserve.server.workers.fault, quick: false}\n",
    ),
    ('"module": "chaos.injectors.kill"\n', ".json", '"module": "distserve.chaos.injectors.kill"\n'),
    ("python3 -m planner.sm_shares --device cuda\n", ".sh", "python3 -m distserve.planner.sm_shares --device cuda\n"),
    (
        "`python -m chaos.proxy --listen 127.0.0.1:0`\n",
        ".md",
        "`python -m distserve.chaos.proxy --listen 127.0.0.1:0`\n",
    ),
]


@pytest.mark.parametrize("text,suffix,expected", CASES, ids=[c[0].strip()[:40] for c in CASES])
def test_each_kind_of_reference_is_rewritten_once(text, suffix, expected):
    out = nr.rewrite(text, suffix, ROOT)
    assert out == expected
    assert nr.rewrite(out, suffix, ROOT) == out  # idempotent: a second run finds nothing


def test_a_form_the_patterns_do_not_know_is_reported_not_mangled():
    text = "import os, \\\n    server.cli\n"
    assert nr.rewrite(text, ".py", ROOT) == text
    assert nr.leftover_imports(text) == [1]
    assert nr.leftover_imports("import os\nfrom distserve.server import cli\nfrom . import x\n") == []


def _tree(root: Path) -> None:
    """A checkout in miniature: two packages, a test module naming them the old way, a symlink folder."""
    (root / "server").mkdir()
    (root / "server" / "__init__.py").write_text("")
    (root / "server" / "cli.py").write_text("def main():\n    return 0\n")
    (root / "distbench").mkdir()
    (root / "distbench" / "__init__.py").write_text("")
    (root / "distbench" / "__main__.py").write_text("")
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text(
        'import subprocess\nimport sys\n\nfrom server.cli import main\n\nARGV = [sys.executable, "-m", "distbench"]\n'
    )
    (root / "distserve").mkdir()
    (root / "distserve" / "server").symlink_to("../server")  # not followed: each file is read once


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "ci" / "namespace_rewrite.py"), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_check_refuses_an_unnamespaced_import_and_the_rewrite_fixes_it(tmp_path):
    _tree(tmp_path)
    p = _run(tmp_path, "--check")
    assert p.returncode == 1
    assert "tests/test_x.py:4: not under `distserve.`: from server.cli import main" in p.stdout
    assert "1 file(s)" in p.stderr

    p = _run(tmp_path)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "tests" / "test_x.py").read_text()
    assert "from distserve.server.cli import main" in text and '"-m", "distserve.distbench"' in text
    assert (tmp_path / "server" / "cli.py").read_text() == "def main():\n    return 0\n"

    p = _run(tmp_path, "--check")
    assert p.returncode == 0, p.stdout
    assert _run(tmp_path).stdout.strip().endswith("0 file(s) changed")


def test_the_checkout_names_every_package_under_the_namespace():
    """What `make lint` runs: a new `from server.x import y` anywhere in the tree fails here too."""
    p = _run(ROOT, "--check")
    assert p.returncode == 0, p.stdout[-4000:]
