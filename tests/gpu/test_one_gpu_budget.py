"""One GPU, default settings and an SM split: skipped without CUDA; run on the lent
H200 with ``python3 -m pytest tests/gpu/test_one_gpu_budget.py -q`` (7B preset; a few minutes)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from distserve.chaos.nan_check import failures, run
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.runner import Options, Workload
from distserve.distbench.runner import run as run_distbench
from distserve.distbench.target import ServeProcess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[2]
MODEL = "preset:llama-2-7b"


def _burst(srv: ServeProcess, n: int, prompt_len: int) -> dict:
    spec = RunSpec(url=srv.url, strategy="closed", concurrency=n, num_prompts=n, seed=1, timeout_s=300.0)
    return run_distbench(
        Options(spec, Workload(prompt_len=str(prompt_len), output_len="16", seed=1), progress=False, token=srv.token)
    )


@pytest.mark.parametrize("extra", [[], ["--sm-split", "60:40"]], ids=["unpartitioned", "sm-split-60-40"])
def test_two_workers_on_one_gpu_with_defaults_serve_a_burst_of_long_prompts(extra):
    if extra and shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("needs CUDA MPS (nvidia-cuda-mps-control)")
    with tempfile.TemporaryDirectory() as tmp:
        with ServeProcess(
            Path(tmp), config={"model": MODEL}, extra_args=["--device", "cuda", *extra], timeout_s=300, cwd=ROOT
        ) as srv:
            workers = srv.workers()
            shares = sorted(w["memory"]["gpu_memory_utilization"] for w in workers)
            assert shares == pytest.approx([0.27, 0.63])  # 0.9 split 0.3 : 0.7
            if extra:
                assert all(w["memory"]["mps"]["split_in_effect"] for w in workers)
            res = _burst(srv, 64, 2032)  # + 16 output tokens: inside the default max_seq_len (2048)
            assert res["completed"] == 64 and res["failed"] == 0
            assert srv.get("/health")["status"] == "ok"
            assert not any(srv.wait_kv_free(10)["used"].values())


def test_nan_check_of_the_7b_preset_at_2048_and_4096():
    result = run(4097, MODEL, "cuda", 11)
    assert failures(result) == []
    ran = {b: r["lengths"] for b, r in result["backends"].items() if "lengths" in r}
    assert {"sdpa", "triton"} <= set(ran)
    for lengths in ran.values():
        assert lengths["2048"] == lengths["4096"] == "ok" and lengths["4097"] == "beyond context (4096)"
