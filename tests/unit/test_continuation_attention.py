"""The fused continuation attention (a prefix-cache hit or a chunked prefill's continuation on CUDA) against
the explicit masked reference, on the CPU: the lower-right causal bias must mask exactly what the boolean mask
did (new token i of Q sees context positions up to S - Q + i), for MHA and GQA. The GPU run of the same path
is tests/gpu/test_gpu_engine.py::test_prefix_cache_hit_logits_match_cold_prefill."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distserve.server.engine.attention.triton_decode import causal_lower_right, continuation_attention

pytestmark = pytest.mark.skipif(causal_lower_right is None, reason="torch < 2.3 has no causal_lower_right")


def reference(q, k, v, scale):
    qlen, slen = q.shape[0], k.shape[0]
    qpos = torch.arange(slen - qlen, slen)[:, None]
    mask = torch.arange(slen)[None, :] <= qpos
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("qlen,slen", [(1, 17), (5, 64), (16, 16), (30, 100)])
def test_continuation_attention_masks_like_the_reference(heads, kv_heads, qlen, slen):
    g = torch.Generator().manual_seed(qlen * 1000 + slen)
    q = torch.randn(qlen, heads, 32, generator=g)
    k = torch.randn(slen, kv_heads, 32, generator=g)
    v = torch.randn(slen, kv_heads, 32, generator=g)
    got = continuation_attention(q, k, v, 0.125)
    assert got.shape == (qlen, heads, 32)
    torch.testing.assert_close(got, reference(q, k, v, 0.125), rtol=1e-5, atol=1e-5)
    # the last new token sees the whole context, the first one not the tokens after it
    if qlen > 1:
        v2 = v.clone()
        v2[-1] += 100.0  # only the last position changes: every new token but the last must not see it
        moved = continuation_attention(q, k, v2, 0.125)
        torch.testing.assert_close(moved[:-1], got[:-1])
        assert not torch.allclose(moved[-1], got[-1])
