"""The per-token and per-step fast paths produce exactly what the plain versions did.

Each fast path (preformatted SSE chunks and NDJSON lines, the lazily re-armed idle timeout,
the model's few-dispatch forward, the runner's token spans) replaced something slower on a
hot path; these tests pin them to the original formulation, byte for byte and bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field

import pytest
import torch

from distserve.server.engine import model as model_mod
from distserve.server.engine.model_config import ModelConfig
from distserve.server.engine.model_runner import _token_span
from distserve.server.engine.ops.layer_ops import apply_rope
from distserve.server.idle import IdleTimeout
from distserve.server.router import streaming
from distserve.server.router.pipeline import TokenEvent
from distserve.server.workers.app import _line, _token_line

TEXTS = [
    "",
    "hello",
    " world",
    'quote " and \\ backslash',
    "tab\tnew\nline\r",
    "\x00\x1f\x7f",
    "é日本語🙂",
    "\u2028\u2029",
    "</script>",
]


# --- SSE chunks -------------------------------------------------------------------------------
def _old_sse(obj: dict) -> bytes:  # the formatting before the templates
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


@dataclass
class _FakeReq:
    request_id: str = "cmpl-abc123"
    prompt_token_ids: list = field(default_factory=lambda: [1, 2, 3])


class _FakeRun:
    def __init__(self, deltas: list[str], reason: str = "length") -> None:
        self.req = _FakeReq()
        self.deltas = deltas
        self.finish_reason: str | None = None
        self.reason = reason
        self.error = None

    async def events(self):
        for i, d in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            if last:
                self.finish_reason = self.reason
            yield TokenEvent([i], last, self.reason if last else None), d

    def usage(self) -> dict:
        return {"prompt_tokens": 3, "completion_tokens": len(self.deltas), "total_tokens": 3 + len(self.deltas)}


async def _collect(gen) -> list[bytes]:
    return [c async for c in gen]


@pytest.mark.parametrize("model", ["/tmp/some model", 'odd"name\\é'])
@pytest.mark.parametrize("reason", ["length", "stop"])
def test_sse_completion_chunks_are_byte_identical(model, reason, monkeypatch):
    monkeypatch.setattr(streaming.time, "time", lambda: 1234567890.5)
    run = _FakeRun(TEXTS, reason)
    got = asyncio.run(_collect(streaming.sse_completion(run, model, True)))
    rid, created = f"cmpl-{run.req.request_id}", 1234567890
    want = [
        _old_sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "text": d, "logprobs": None, "finish_reason": reason if i == len(TEXTS) - 1 else None}
                ],
            }
        )
        for i, d in enumerate(TEXTS)
    ]
    want.append(
        _old_sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": run.usage(),
            }
        )
    )
    want.append(b"data: [DONE]\n\n")
    assert got == want


@pytest.mark.parametrize("reason", ["length", "stop"])
def test_sse_chat_chunks_are_byte_identical(reason, monkeypatch):
    monkeypatch.setattr(streaming.time, "time", lambda: 42.0)
    model = "m/é"
    run = _FakeRun(TEXTS, reason)
    got = asyncio.run(_collect(streaming.sse_chat(run, model, False)))
    rid = f"chatcmpl-{run.req.request_id}"
    want = []
    for i, d in enumerate(TEXTS):
        delta = {"role": "assistant", "content": d} if i == 0 else {"content": d}
        want.append(
            _old_sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": 42,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": reason if i == len(TEXTS) - 1 else None,
                        }
                    ],
                }
            )
        )
    want.append(b"data: [DONE]\n\n")
    assert got == want


# --- NDJSON token lines ------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [[], [0], [7, 12345, 3], list(range(40))])
@pytest.mark.parametrize(
    "finished,reason",
    [(False, None), (True, None), (True, "length"), (True, "stop"), (True, "abort"), (True, 'we"ird')],
)
def test_token_line_matches_generic_line(tokens, finished, reason):
    assert _token_line(tokens, finished, reason) == _line(token_ids=tokens, finished=finished, finish_reason=reason)
    old = (
        json.dumps(
            {k: v for k, v in dict(token_ids=tokens, finished=finished, finish_reason=reason).items() if v is not None},
            separators=(",", ":"),
        )
        + "\n"
    ).encode()
    assert _token_line(tokens, finished, reason) == old


# --- IdleTimeout -------------------------------------------------------------------------------
def test_idle_timeout_fires_only_after_a_silent_wait():
    """The period bounds each wait, not the stream: many prompt waits spread over several periods
    pass, a late-but-inside-the-period arrival after them passes (the lazily re-armed timer is not
    stale), and only a wait with nothing arriving times out."""

    async def main():
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        got = []
        with IdleTimeout(0.1) as idle:
            for i in range(8):  # 8 x 30 ms spent outside wait(): 240 ms, over two periods
                await asyncio.sleep(0.03)
                q.put_nowait(i)
                got.append(await idle.wait(q.get()))
            loop.call_later(0.02, q.put_nowait, 8)  # well inside one fresh period
            got.append(await idle.wait(q.get()))
            with pytest.raises(TimeoutError):
                await idle.wait(q.get())
        return got

    assert asyncio.run(main()) == list(range(9))


def test_idle_timeout_lets_other_cancellations_through():
    async def main():
        q: asyncio.Queue = asyncio.Queue()

        async def waiter():
            with IdleTimeout(10.0) as idle:
                await idle.wait(q.get())

        t = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(main())


def test_idle_timeout_does_not_cancel_while_busy_elsewhere():
    async def main():
        with IdleTimeout(0.05) as idle:
            await asyncio.sleep(0.15)  # not inside wait(): e.g. sending to a slow reader
            return await idle.wait(asyncio.sleep(0, result="ok"))

    assert asyncio.run(main()) == "ok"


# --- model fast path ---------------------------------------------------------------------------
def test_rope_is_bitwise_hugging_faces_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    rot = model_mod.RotaryEmbedding(cfg)
    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(37, 6, 64).to(dtype), torch.randn(37, 2, 64).to(dtype)
        pos = torch.randint(0, 500, (37,))
        cos, signed_sin = rot.tables(pos, dtype, int(pos.max()))
        # Hugging Face's form, on rows of the same float32 tables (the fused kernel's input) rounded to the dtype
        cos32, sin32 = rot.float_tables(int(pos.max()), pos.device)
        want_q, want_k = apply_rotary_pos_emb(q, k, cos32[pos].to(dtype), sin32[pos].to(dtype))
        assert torch.equal(apply_rope(q, cos, signed_sin), want_q)
        assert torch.equal(apply_rope(k, cos, signed_sin), want_k)


def test_token_span_matches_all_token_ids():
    @dataclass
    class Seq:
        prompt_token_ids: list
        output_token_ids: list

        @property
        def all_token_ids(self):
            return self.prompt_token_ids + self.output_token_ids

    rng = random.Random(1)
    for _ in range(200):
        s = Seq(
            [rng.randrange(100) for _ in range(rng.randint(1, 20))],
            [rng.randrange(100) for _ in range(rng.randint(0, 10))],
        )
        n = len(s.all_token_ids)
        a = rng.randint(0, n - 1)
        b = rng.randint(a + 1, n)
        assert _token_span(s, a, b) == s.all_token_ids[a:b]
