"""The Ray launcher's pure parts (no Ray needed): pool resources to actor options, the resources flag,
the config section, and the CLI's one-sentence usage errors before anything connects to a cluster."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distserve.server.config import ConfigError, load_config
from distserve.server.launchers.ray_placement import actor_options, parse_resources, torch_threads


def test_cpu_and_gpu_become_ray_options_and_the_rest_stay_custom_resources():
    assert actor_options((), 1.0, gpu=False) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert actor_options((), 1.0, gpu=True) == {"num_cpus": 1.0, "num_gpus": 1.0}
    opts = actor_options((("CPU", 2.0), ("GPU", 0.5), ("prefill_node", 1.0)), 1.0, gpu=True)
    assert opts == {"num_cpus": 2.0, "num_gpus": 0.5, "resources": {"prefill_node": 1.0}}
    assert torch_threads((("CPU", 3.0),), 1.0) == 3 and torch_threads((("CPU", 0.5),), 1.0) == 1


@pytest.mark.parametrize("text", ["", "[1]", '{"x": -1}', '{"x": true}', '{"": 1}', "{x: 1}"])
def test_bad_resources_are_one_sentence(text):
    with pytest.raises(ValueError, match="resources must"):
        parse_resources(text)


def test_config_section_validates_and_round_trips():
    cfg = load_config(None, {"ray": {"decode": {"resources": {"decode_node": 1, "GPU": 1}}, "drain_timeout_s": 5}})
    assert dict(cfg.ray.decode.resources) == {"GPU": 1.0, "decode_node": 1.0}
    assert cfg.to_dict()["ray"]["decode"]["resources"] == {"GPU": 1.0, "decode_node": 1.0}
    hash(cfg)  # still frozen and hashable
    with pytest.raises(ConfigError, match="'ray.prefill.resources' must be a mapping"):
        load_config(None, {"ray": {"prefill": {"resources": {"prefill_node": "one"}}}})
    with pytest.raises(ConfigError, match="ray.drain_timeout_s"):
        load_config(None, {"ray": {"drain_timeout_s": 0}})


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["scale", "--prefill", "0"], "--prefill must be >= 1"),
        (["scale", "--decode", "-1"], "--decode must be >= 1"),
        (["scale", "--decode-resources", "x"], None),  # not a scale flag: argparse's own exit 2
        (["serve", "--launcher", "ray", "--prefill-resources", "[1]"], "--prefill-resources: resources must"),
        (["serve", "--launcher", "ray", "--devices", "cuda:0,cuda:1"], "--devices and --log-dir are for the local"),
    ],
)
def test_usage_errors_exit_2_with_one_sentence(args, says):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    if says:
        assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_ray_is_imported_only_by_the_ray_launcher_and_its_absence_is_one_sentence():
    code = (
        "import sys; import distserve.server.cli; from distserve import server; assert 'ray' not in sys.modules, 'ray imported by the CLI'; "
        "sys.modules['ray'] = None; sys.exit(server.cli.main(%r))"
    )
    for argv in (["scale", "--decode", "2"], ["serve", "--launcher", "ray"]):
        r = subprocess.run([sys.executable, "-c", code % argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "pip install -e '.[ray]' in a distserve checkout" in r.stderr, r.stderr
