"""The demo's first act on a real model: a few chat questions through ``/v1/chat/completions``, answers printed.

Kept apart from the load part of the demo so that either can move without the other.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

QUESTIONS = (
    "What is the capital of France?",
    "Name the three primary colors.",
)


def chat(url: str, question: str, max_tokens: int = 48, timeout_s: float = 300.0) -> tuple[str, dict]:
    """(answer, usage) for one greedy chat completion; a 503 (no healthy pair for a moment) is retried."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                resp = json.loads(r.read())
            return resp["choices"][0]["message"]["content"].strip(), resp.get("usage", {})
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > deadline:
                raise RuntimeError(f"chat request failed: HTTP {e.code}: {e.read()[:300]!r}") from None
            time.sleep(1.0)


def ask_questions(url: str, model_name: str, questions: tuple[str, ...] = QUESTIONS) -> None:
    print(f"\nchat with {model_name} (greedy, through the router: prefill worker -> KV transfer -> decode worker)")
    for q in questions:
        t0 = time.perf_counter()
        answer, usage = chat(url, q)
        dt = time.perf_counter() - t0
        print(f"  Q: {q}\n  A: {answer}\n     ({usage.get('completion_tokens', '?')} tokens in {dt:.1f} s)", flush=True)
