"""distbench --sampling: what the requests send, and the result names it."""

from __future__ import annotations

import pytest

from distserve.distbench.cli import main
from distserve.distbench.client import body_for
from distserve.distbench.datasets import Item
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.runner import Options, Workload, run
from distserve.distbench.sampling import sampling_fields
from tests.stub_server import StubServer


def test_sampling_specs_become_request_fields():
    assert sampling_fields("openai-default") == {}
    assert sampling_fields("greedy") == {"temperature": 0.0}
    assert sampling_fields("0.7,0.95") == {"temperature": 0.7, "top_p": 0.95}
    assert sampling_fields("1,1,50") == {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
    for bad in ("hot", "0.7", "0.7,0", "3,1", "1,1,x", "1,1,1,1"):
        with pytest.raises(ValueError, match="--sampling"):
            sampling_fields(bad)
    item = Item(prompt_ids=[1, 2, 3], text=None, prompt_len=3, output_len=4)
    plain = body_for("/v1/completions", item, None, None)  # the default: what the OpenAI SDK sends
    assert "temperature" not in plain and "top_p" not in plain and plain["max_tokens"] == 4
    assert body_for("/generate", item, None, None, sampling_fields("greedy"))["temperature"] == 0.0


def test_bad_sampling_is_a_usage_error_and_the_result_records_the_sampling(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 512}')
    assert main(["run", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--sampling", "warm"]) == 2
    assert "--sampling" in capsys.readouterr().err
    with StubServer() as srv:
        res = run(
            Options(
                RunSpec(url=srv.url, strategy="closed", concurrency=1, num_prompts=3),
                Workload(prompt_len="4", output_len="2", tokenizer=str(tmp_path)),
                progress=False,
            )
        )
    assert res["sampling"] == res["config"]["sampling"] == "openai-default" and res["failed"] == 0
