"""First-use rough edges: clear one-line errors before anything starts, help text on every option,
--version, the log level reaching child processes, file modes, and orphaned temporary folders."""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from distserve.server import preflight
from distserve.server.cli import LOG_LEVEL_ENV, build_parser


def test_port_in_use_is_one_sentence():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        msg = preflight.port_problem("127.0.0.1", port)
        assert msg and "already in use" in msg and str(port) in msg
    assert preflight.port_problem("127.0.0.1", 0) is None


def test_serve_on_a_busy_port_exits_2_without_traceback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "distserve.server.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2
    assert "already in use" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_sentence():
    assert "CUDA is not available" in preflight.device_problem(["cuda:0"])
    assert preflight.device_problem(["cpu"]) is None
    r = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "serve", "--device", "cuda", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "CUDA is not available" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "model,words",
    [
        ("preset:nope", "unknown model preset 'nope'"),
        ("/nonexistent/model", "does not exist"),
        ("{tmp}", "config.json"),
    ],
)
def test_a_model_that_cannot_load_is_one_sentence_before_anything_starts(tmp_path, model, words):
    """Before: every worker died with a traceback and serve said only 'exited with status 1 during start-up'."""
    model = model.format(tmp=tmp_path)  # an empty folder: not a Hugging Face model folder
    assert words in preflight.model_problem(model)
    r = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "serve", "--model", model, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_models_that_resolve_pass_the_model_preflight():
    assert preflight.model_problem(None) is None and preflight.model_problem("preset:tiny-gpu") is None


def test_orphaned_launcher_folders_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{preflight.TMP_PREFIX}{dead.pid}-abc"
    alive = tmp_path / f"{preflight.TMP_PREFIX}{os.getpid()}-def"
    unrelated = tmp_path / "distserve-cache"
    for d in (orphan, alive, unrelated):
        d.mkdir()
        (d / "config.yaml").write_text("x: 1\n")
    assert preflight.sweep_orphan_tmp(str(tmp_path)) == [orphan]
    assert not orphan.exists() and alive.exists() and unrelated.exists()


def test_every_option_has_help():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if action.option_strings and not action.help:
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing


def test_version_and_log_level_env(monkeypatch):
    r = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.startswith("distserve ")
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; from distserve.server.cli import main; "
            "sys.argv=['distserve']; main(['--log-level', 'debug', 'make-tiny-model', sys.argv[0] or "
            "'/nonexistent/x', '--vocab', '10']); print(os.environ['DISTSERVE_LOG_LEVEL'])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.strip().endswith("DEBUG"), r.stderr


def test_tiny_model_files_share_one_mode(tmp_path):
    from distserve.server.engine.tiny_model import make_tiny_model

    out = make_tiny_model(tmp_path / "m", layers=1, hidden=64, heads=2, kv_heads=2)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes


# --- round 2: the source article's forms, typos, exit codes ----------------------------------------

ARTICLE_CONFIG = """\
prefill:
  max_batch_size: 32
  max_seq_len: 2048
  attention_backend: "flash_attn_v2"
decode:
  max_batch_size: 128
  max_concurrent_requests: 64
  sampling_strategy: "top_p"
  top_p: 0.95
  gc_interval_ms: 500
  max_stale_slots: 16
rdma:
  zero_copy_threshold: 16
"""


def _cli(*argv: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_the_articles_config_loads_with_a_warning_naming_the_new_key(tmp_path, caplog):
    from distserve.server.config import load_config

    path = tmp_path / "distserve_config.yaml"
    path.write_text(ARTICLE_CONFIG.replace('"flash_attn_v2"', '"sdpa"'))
    cfg = load_config(path)
    assert cfg.kv_transfer.zero_copy_threshold_mb == 16.0 and cfg.decode.max_stale_slots == 16
    assert "rdma.zero_copy_threshold is spelled kv_transfer.zero_copy_threshold_mb" in caplog.text


def test_a_key_in_the_wrong_section_gets_a_did_you_mean(tmp_path):
    from distserve.server.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("prefill:\n  gc_interval_ms: 500\n")
    with pytest.raises(ConfigError, match="did you mean 'decode.gc_interval_ms'"):
        load_config(path)


def test_flash_attn_v2_on_the_cpu_is_one_sentence_exit_2(tmp_path):
    """Before: a worker's 30-line traceback and exit 1. The article's config, as written, on a CPU box."""
    path = tmp_path / "distserve_config.yaml"
    path.write_text(ARTICLE_CONFIG)
    r = _cli("serve", "--config", str(path), "--port", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "'flash_attn_v2' needs a CUDA device" in errors[0]
    assert "kv_transfer.zero_copy_threshold_mb" in r.stderr  # the alias warning came first
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:  # on a GPU box without the package: one sentence too
        assert "flash-attn package" in preflight.backend_problem({"prefill": "flash_attn_v2"}, ["cuda:0"])
    assert preflight.backend_problem({"prefill": "sdpa", "decode": "auto"}, ["cpu"]) is None


def test_a_model_too_big_for_this_machines_memory_is_refused_before_the_oom_killer(monkeypatch):
    monkeypatch.setattr(preflight, "_mem_available_bytes", lambda: 8 << 30)
    msg = preflight.memory_problem("preset:llama-2-7b", ["cpu", "cpu"], 2)
    assert msg and "6.74 B parameters" in msg and "8.0 GiB available" in msg
    assert preflight.memory_problem("preset:llama-2-7b", ["cuda:0", "cuda:1"], 0) is None
    assert preflight.memory_problem(None, ["cpu", "cpu"], 2) is None  # the tiny model fits anywhere


def test_serve_typo_names_the_flag_it_meant():
    r = _cli("serve", "--modle", "x")
    assert r.returncode == 2 and "did you mean --model?" in r.stderr and "usage: distserve serve" in r.stderr


def test_the_articles_worker_flags_map_or_explain():
    args = build_parser().parse_args(["worker", "--role", "prefill", "--router", "http://r", "--model-path", "/m"])
    assert args.model == "/m"
    r = _cli("worker", "--role", "prefill", "--router", "http://r", "--num-gpus", "2")
    assert r.returncode == 2 and "--devices cuda:0,cuda:1" in r.stderr


def test_router_without_a_token_is_one_sentence_exit_2():
    r = _cli("router", "--port", "0", env={"DISTSERVE_ADMIN_TOKEN": ""})
    assert r.returncode == 2 and "only `distserve serve` generates one" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_chaos_inject_without_a_token_is_bad_input_exit_2():
    r = _cli(
        "chaos", "inject", "pause", "router_url=http://127.0.0.1:9", "role=decode", env={"DISTSERVE_ADMIN_TOKEN": ""}
    )
    assert r.returncode == 2 and "token" in r.stderr, r.stderr


def test_max_seq_len_above_the_models_context_warns(tmp_path):
    with socket.socket() as s:  # a busy port stops serve right after its checks: nothing is started
        s.bind(("127.0.0.1", 0))
        s.listen()
        path = tmp_path / "c.yaml"
        path.write_text("prefill:\n  max_seq_len: 4096\n")
        r = _cli("serve", "--config", str(path), "--port", str(s.getsockname()[1]))
    assert r.returncode == 2 and "warning: prefill.max_seq_len 4096 is above the model's context length" in r.stderr


def test_breaker_transitions_carry_wall_clock_times():
    from prometheus_client import CollectorRegistry

    from distserve.server.config import RouterConfig
    from distserve.server.router.sla_live import SlaLive
    from distserve.sla.breaker import BreakerState, Transition

    mono = {"t": 100.0}
    cfg = RouterConfig.from_dict({"breaker": {"enabled": True}})
    live = SlaLive(cfg, CollectorRegistry(), backup_configured=True, clock=lambda: mono["t"], wall=lambda: 1.8e9)
    assert live.breaker is not None
    live.breaker.transitions.append(
        Transition(at=90.0, from_state=BreakerState.CLOSED, to_state=BreakerState.OPEN, reason="x")
    )
    [t] = live.status()["breaker"]["transitions"]
    assert t["at_unix"] == 1.8e9 - 10 and t["at_iso"] == "2027-01-15T07:59:50.000+00:00"


# --- against one real server (the tiny model, one colocated worker) ---------------------------------------------


TOKEN = "first-use-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from distserve.distbench.target import ServeProcess

    # max_seq_len 1024, below the tiny model's 2048 context: what doctor should see on the served model
    cfg = {"prefill": {"max_seq_len": 1024}}
    with ServeProcess(tmp_path_factory.mktemp("serve"), "colocated", decode=1, config=cfg, token=TOKEN) as s:
        yield s


def _distbench(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.distbench", *argv], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_the_articles_generate_url_is_understood(served, tmp_path):
    """Before: `--url .../generate` became the base URL and the run died on a misleading vocabulary error."""
    out = tmp_path / "r.json"
    r = _distbench(
        "run", "--url", f"{served.url}/generate", "--concurrency", "2", "--num-prompts", "4", "--prompt-len", "16",
        "--output-len", "4", "--no-progress", "--save-result", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["endpoint"] == "/generate" and res["completed"] == 4
    assert res["TTFT_P99"] == res["p99_ttft_ms"] > 0  # the article's key
    clash = _distbench("run", "--url", f"{served.url}/generate", "--endpoint", "/v1/completions", "--concurrency", "1")
    assert clash.returncode == 2 and "--url ends in /generate" in clash.stderr


def test_sharegpt_prompts_longer_than_the_server_allows_are_dropped_and_counted(served, tmp_path):
    """Before: 21 of 100 README ShareGPT requests failed with a 400, listed as 21 separate '1 ×' lines."""
    convs = [
        {"conversations": [{"from": "human", "value": f"question {i} " * (400 if i % 3 == 0 else 3)},
                           {"from": "gpt", "value": "an answer of a few words " * 2}]}
        for i in range(9)
    ]  # fmt: skip
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(convs))  # every third prompt is ~4400 bytes: over the server's 1024
    out = tmp_path / "r.json"
    r = _distbench(
        "run", "--url", served.url, "--request-rate", "20", "--dataset", f"sharegpt:{data}",
        "--endpoint", "/v1/chat/completions", "--num-prompts", "9", "--no-progress", "--save-result", str(out),
    )  # fmt: skip
    res = json.loads(out.read_text())
    assert res["dataset_fit"] == {"max_model_len": 1024, "considered": 9, "dropped": 3}, r.stderr
    assert res["failed"] == 0 and r.returncode == 0, r.stdout
    assert "dropped 3 of 9 prompts longer than the server's max_model_len 1024" in r.stdout


def test_plot_of_runs_at_one_rate_with_and_without_an_slo(served, tmp_path):
    """Before: the README's `plot a.json b.json sweep/sweep.json` died with "'<' not supported between 'NoneType' and
    'float'": a (with --slo) and b (without) ran at the same rate, and sorting the points compared None with a float."""
    pytest.importorskip("matplotlib")
    common = ["--url", served.url, "--request-rate", "8", "--num-prompts", "3", "--prompt-len", "8",
              "--output-len", "2", "--no-progress"]  # fmt: skip
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert _distbench("run", *common, "--slo", "ttft:60s,tpot:10s", "--save-result", str(a)).returncode == 0
    assert _distbench("run", *common, "--save-result", str(b)).returncode == 0
    for order in ((a, b), (b, a)):
        r = _distbench("plot", *map(str, order), "--out-dir", str(tmp_path / "plots"))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert "vs_rate.png" in r.stdout


def test_failures_are_grouped_by_reason_with_numbers_masked():
    from distserve.distbench.metrics import failure_reasons
    from distserve.distbench.records import RequestRecord

    errors = [f"HTTP 400: prompt: {n} tokens is longer than max_seq_len allows (2048 tokens)" for n in (3468, 2100)]
    records = [RequestRecord(i, 0.0, error=e) for i, e in enumerate([*errors, "HTTP 503: overloaded"])]
    assert failure_reasons(records) == {
        "HTTP 400: prompt: N tokens is longer than max_seq_len allows (N tokens)": 2,
        "HTTP 503: overloaded": 1,
    }


def test_response_ids_carry_one_prefix(served):
    import urllib.request

    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{served.url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        rid = json.loads(r.read())["id"]
    assert rid.startswith("cmpl-") and not rid.startswith("cmpl-comp-"), rid


def test_doctor_checks_the_served_models_context_not_the_built_in_one(served):
    r = _cli("doctor", "--router", served.url, "--only", "router,model", env={"DISTSERVE_ADMIN_TOKEN": TOKEN})
    assert "[DRIFT] served max_model_len vs the context of" in r.stdout and ": 1024 (want 2048)" in r.stdout
    assert "prefill.max_seq_len vs model context length" not in r.stdout  # the built-in model's check: not run
    assert "prefill first" not in r.stdout and r.returncode == 1


def test_doctor_says_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        r = _cli("doctor", "--router", f"http://127.0.0.1:{port}", "--only", "router")
    assert r.returncode == 1 and "router /health: connection refused" in r.stdout and "(want 200)" in r.stdout
    assert ": 0 " not in r.stdout


def test_doctor_never_lowers_a_larger_buffer():
    from distserve.chaos.doctor import _at_least, _raised

    host, baseline = "4096 131072 33554432", "4096 262144 16777216"
    assert not _at_least(host, baseline)  # the default size is below the baseline's: drift
    assert _raised(host, baseline) == "4096 262144 33554432"  # the fix raises it and keeps the 32 MiB max
    assert _at_least("4096 262144 33554432", baseline) and _raised("33554432", "16777216") == "33554432"


def test_the_demos_pass_names_its_thresholds_and_the_seed_is_explained():
    from distserve.chaos.journal import Journal, markdown
    from distserve.distbench.demo import _thresholds

    line = _thresholds(str(Path(__file__).resolve().parents[2] / "configs/sla/demo_smollm2.yaml"))
    assert "TTFT P90 <= 10000 ms" in line and "availability >= 100%" in line
    report = markdown(Journal(drill="worker_kill", title="t", incident="A worker dies (seed §4: worker death)"))
    assert "is section N of the source article this project was built from" in report


def test_the_commands_of_from_the_article_parse_as_written():
    """docs/FROM_THE_ARTICLE.md gives a command for each of the article's; each must be a valid command line."""
    import re
    import shlex

    from distserve.distbench.cli import build_parser as distbench_parser
    from distserve.distbench.cli import options_from

    text = (Path(__file__).resolve().parents[2] / "docs" / "FROM_THE_ARTICLE.md").read_text()
    ours = re.findall(r"`(?:[A-Z_]+=\S+ )?(distserve (?:serve|router|worker|doctor|chaos|gate)[^`]*)`", text)
    benches = re.findall(r"`(distbench run [^`]+)`", text)
    assert len(ours) >= 8 and benches
    for cmd in (c for c in ours if len(shlex.split(c)) > 2):  # "what `distserve worker` does" names, not runs
        args, extra = build_parser().parse_known_args(shlex.split(cmd)[1:])
        assert not extra, cmd
    for cmd in benches:
        opts = options_from(distbench_parser().parse_args(shlex.split(cmd)[1:]))
        assert opts.spec.endpoint == "/generate" and opts.spec.url == "http://localhost:8080", cmd
    paths = re.findall(
        r"[`\s]((?:server|configs|ci|docs|bench|distbench|chaos|planner|sla)/[\w./-]+\.(?:py|ya?ml|md))", text
    )
    assert "configs/drills/memory_limit.yaml" in paths
    for path in paths:
        assert (ROOT / path).is_file(), f"docs/FROM_THE_ARTICLE.md names {path}, which is not in the checkout"


ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The shell lines of the README's ```bash blocks, continuation lines joined, comments and a trailing `&` cut."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text()
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        pending = ""
        for raw in block.splitlines():
            line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line = (pending + line).strip()
            try:
                shlex.split(line)
            except ValueError:  # a quote left open: the command goes on on the next line
                pending = line + "\n"
                continue
            pending = ""
            line = line.rstrip("&").strip()
            if line:
                out.append(line)
    return out


def test_every_command_line_of_the_readme_parses_as_written():
    """Each `distserve ...` / `distbench ...` line of the README's shell blocks is a valid command line, the files
    it names exist in the checkout, and so do the `make` targets and `python -m bench...` modules it gives."""
    import re
    import shlex

    from distserve.distbench.cli import build_parser as distbench_parser

    lines = readme_commands()
    commands = [shlex.split(ln) for ln in lines if ln.startswith(("distserve ", "distbench "))]
    assert len(commands) > 30
    for argv in commands:
        if argv[0] == "distbench":
            args = distbench_parser().parse_args(argv[1:])  # exits 2 on anything it does not know
            for variant in getattr(args, "variant", None) or []:  # repeat: each variant is a `distbench run`
                distbench_parser().parse_args(["run", *shlex.split(variant.split("=", 1)[1])])
        elif argv[1] != "sla":  # `distserve sla ...` goes to sla's own parser
            _, extra = build_parser().parse_known_args(argv[1:])
            assert not extra, argv
        for arg in argv:
            if re.match(r"(configs|ci|bench|tests|docs)/\S+\.(ya?ml|json|py|md)$", arg):
                assert (ROOT / arg).is_file(), f"{argv}: {arg} is not in the checkout"
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"`make ([a-z-]+)`", readme)) | {ln.split()[1] for ln in lines if ln.startswith("make ")}
    assert {"demo", "test", "demo-tiny", "lint"} <= targets
    for t in targets:
        assert re.search(rf"^{t}:", makefile, re.M), f"make {t}: no such target"
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for mod in re.findall(r"python3? -m (bench(?:\.[a-z_0-9]+)+)", doc.read_text()):
            path = ROOT / mod.replace(".", "/")
            assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), f"{doc.name}: {mod}"


def test_readme_commands_that_cannot_run_here_say_why_in_one_sentence():
    """The README's lines for a placeholder model folder, CUDA and Ray, run word for word from the checkout's root on
    a machine without them: exit 2 and one sentence, before anything starts."""
    import importlib.util
    import shlex

    import torch

    wanted = {"distserve serve --model /path/to/hf-llama --config configs/distserve_config.yaml": "does not exist"}
    if not torch.cuda.is_available():
        wanted["distserve serve --device cuda --model preset:llama-2-7b"] = "CUDA is not available"
    if importlib.util.find_spec("ray") is None:
        wanted["distserve serve --launcher ray --address HEAD_IP:6379"] = "pip install -e '.[ray]' in a distserve"
    lines = readme_commands()
    for cmd, words in wanted.items():
        assert cmd in lines, f"the README no longer shows {cmd!r}"
        r = subprocess.run(
            [sys.executable, "-m", "distserve.server.cli", *shlex.split(cmd)[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (cmd, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (cmd, r.stderr)


def test_the_readmes_curl_lines_work_against_a_server(served):
    """Every `curl` line of the README, word for word but for the server's address, gets a well-formed answer."""
    import shutil

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    hostport = served.url.removeprefix("http://")
    curls = [ln for ln in readme_commands() if ln.startswith("curl ")]
    assert len(curls) >= 9 and all("localhost:8080" in c for c in curls)
    for line in curls:
        r = subprocess.run(
            ["bash", "-c", line.replace("localhost:8080", hostport)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "DISTSERVE_ADMIN_TOKEN": TOKEN},
        )
        out = r.stdout
        assert r.returncode == 0 and out, (line, r.stderr)
        if "/metrics" in line:
            assert "distserve_time_to_first_token_seconds" in out, line
        elif '"stream": true' in line:
            events = [e.removeprefix("data: ") for e in out.split("\n\n") if e.strip()]
            assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1]), line
        else:
            for doc in out.strip().splitlines():  # /tokenize then /version: one JSON document a line
                body = json.loads(doc)
                assert "error" not in body and "detail" not in body, (line, body)
                # short answers: a README request without max_tokens runs to the context length (minutes here)
                assert body.get("usage", {}).get("completion_tokens", 0) <= 64, (line, body["usage"])


def test_doctors_memory_limit_fix_speaks_this_hosts_cgroup_version():
    """Before: on a cgroup v1 host, doctor printed the v2 commands (memory.max in /sys/fs/cgroup), which fail there."""
    from distserve.chaos.doctor import memory_limit_fix

    v1 = memory_limit_fix(42, ("v1", "/sys/fs/cgroup/memory"))
    assert "echo 70G > /sys/fs/cgroup/memory/distserve-decode/memory.limit_in_bytes" in v1 and "memory.max" not in v1
    assert "echo 42 > /sys/fs/cgroup/memory/distserve-decode/cgroup.procs" in v1
    v2 = memory_limit_fix(42, ("v2", "/sys/fs/cgroup"))
    assert "echo 70G > /sys/fs/cgroup/distserve-decode/memory.max" in v2 and "limit_in_bytes" not in v2


def test_report_charts_label_their_axis_without_exponents_or_overlap():
    """Before: a y tick of 11000 ms read '1.1e+04' and ran into the 'ms' label above it."""
    import re

    from distserve.reports.html import ML, svg_plot

    rows = [
        {"metric": "ttft", "threshold": 250.0, "observed": o, "status": "fail", "window_start": f"2026-12-01T0{i}:00"}
        for i, o in enumerate((11000.0, 9000.0))
    ]
    svg = svg_plot(rows, "TTFT P99")
    ticks = re.findall(rf'<text x="{ML - 4}" [^>]*>([^<]*)</text>', svg)
    assert len(ticks) == 5 and "12,100" in ticks and not any("e+" in t for t in ticks), ticks
    [unit] = re.findall(r'<text x="12" [^>]*transform="rotate\(-90[^>]*>ms</text>', svg)


def test_profiles_thread_lines_say_what_they_mean(monkeypatch):
    """Before: `distserve profile` printed 'threads 2, neighbours 0: prefill x0.28' and nothing said what x0.28 is."""
    from distserve.planner import profiler

    monkeypatch.setattr(profiler.os, "sched_getaffinity", lambda _pid: {0}, raising=False)  # one CPU: no neighbour
    import torch

    lines: list[str] = []
    threads = torch.get_num_threads()
    try:
        points = profiler.measure_threads(None, 1, lines.append)
    finally:
        torch.set_num_threads(threads)  # it leaves torch at 1 thread: not for the tests after this one
    assert lines[0] == profiler.THREADS_LEGEND and "relative to 1 thread alone" in lines[0]
    assert lines[1].startswith("threads 1, neighbours 0: prefill x1.00") and {p.threads for p in points} == {1}


def test_a_plan_that_no_layout_meets_says_what_to_change():
    """Before: the README's CPU plan on a busy 2-core box ended 'no layout meets the SLO ...' and exit 1, no way on."""
    fixture = ROOT / "tests" / "fixtures" / "planner" / "cpu-tiny-2026-11-30.json"
    r = _cli("plan", "--profile", str(fixture), "--workload", "prompt=512,output=64", "--slo", "ttft:1ms,tpot:1ms",
             "--devices", "2")  # fmt: skip
    assert r.returncode == 1 and "no layout meets the SLO at any rate" in r.stdout, r.stdout + r.stderr
    assert "loosen the SLO (--slo)" in r.stdout and "profile again on an idle machine" in r.stdout


def test_a_child_killed_during_start_up_is_named_and_sigkill_explained():
    """Before: 'process 12329 (worker --role) exited with status -9 during start-up': the label cut short and
    nothing saying that -9 is SIGKILL, most likely the out-of-memory killer."""
    from types import SimpleNamespace

    from distserve.server.launcher import Launcher

    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    child = subprocess.Popen([sys.executable, "-c", code, "--worker-id", "prefill-0", "--role", "prefill"])
    child.wait(timeout=60)
    stand_in = SimpleNamespace(procs=[child])  # wait_healthy reads only the children (and the router, never reached)
    with pytest.raises(RuntimeError) as e:
        Launcher.wait_healthy(stand_in, 2, 0.0)  # type: ignore[arg-type]
    assert f"process {child.pid} (prefill-0) exited with status -9 during start-up" in str(e.value)
    assert "SIGKILL: most likely the kernel's out-of-memory killer" in str(e.value)


def test_a_gate_that_would_run_nothing_does_not_say_go(tmp_path):
    """Before: `distserve gate --quick --only tests` ran 0 items and printed 'gate: GO', exit 0."""
    r = _cli("gate", "--quick", "--only", "tests", "--out", str(tmp_path / "g"))
    assert r.returncode == 2 and "--only tests: not a quick item; run it without --quick" in r.stderr, r.stderr
    assert "GO" not in r.stdout
    r = _cli("gate", "--only", "nan,nope", "--out", str(tmp_path / "g"))
    assert r.returncode == 2 and "--only: no item nope in ci/release_gate.yaml; items: tests, nan," in r.stderr
