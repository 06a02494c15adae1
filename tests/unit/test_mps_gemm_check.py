"""The start-up check that an MPS SM share computes right (server.mps.gemm_self_check): a right GEMM
passes, a GEMM that returns NaN or wrong values in one tile is named in one sentence."""

import torch

from distserve.server.mps import gemm_self_check


def test_a_right_gemm_passes():
    assert gemm_self_check(torch.device("cpu"), hidden=256, out_features=384, rows=(1, 8, 33), reps=2) is None


def _corrupt(kind):
    calls = []

    def mm(a, b):
        calls.append(a.shape[0])
        y = a @ b
        if len(calls) == 3:  # the third call only: a fault that is not there every time
            y = y.clone()
            y[:2, :16] = float("nan") if kind == "nan" else y[:2, :16] + 3.0
        return y

    return mm


def test_nan_in_one_tile_is_named(monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40")
    said = gemm_self_check(
        torch.device("cpu"), hidden=256, out_features=384, rows=(1, 8), reps=2, matmul=_corrupt("nan")
    )
    assert said is not None
    assert "8 x 256 by 256 x 384" in said and "40 % of the SMs" in said and "32 wrong values" in said
    assert "(32 NaN/Inf)" in said and "--sm-split" in said


def test_finite_but_wrong_values_are_caught():
    said = gemm_self_check(
        torch.device("cpu"), hidden=256, out_features=384, rows=(1, 8), reps=2, matmul=_corrupt("off")
    )
    assert said is not None and "32 wrong values" in said and "(0 NaN/Inf)" in said
