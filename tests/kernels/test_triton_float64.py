"""Both Triton kernels through Triton's interpreter at a real model's heads and lengths (Llama-3-8B: 32 query heads,
8 KV heads, head_dim 128; contexts up to 3,000), against a float64 oracle written from docs/design.md alone
(float64_oracle.py): left padding, the last trivial and the first non-trivial context, scalar and per-row lambda.
On a GPU the kernels run compiled, and bfloat16 joins (Triton 3.9's interpreter computes tl.dot on bfloat16 wrongly,
so only a GPU checks it: scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from float64_oracle import decisions_away_from_boundary, decode_step_float64

from alspec_eval.kernels import triton_decode

pytestmark = pytest.mark.slow  # about a minute in the interpreter

HQ, HKV, DIM, LENGTH, WINDOW = 32, 8, 128, 3000, 64
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative, of the whole row
D_RTOL = {torch.float32: 5e-4, torch.float16: 0.1, torch.bfloat16: 0.1}  # d = ||spec - exact||, a small difference
MARGIN = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}  # |d - lambda n| / n a decision is sure
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly: bfloat16 is checked on a GPU only
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if DEVICE == "cuda" else [])]


def _inputs(dtype: torch.dtype, align: int) -> tuple:
    generator = torch.Generator().manual_seed(7)
    last_trivial = 2 * WINDOW - 1  # context 2S: A~ is A
    cur_pos = [last_trivial + 5, 2 * WINDOW + 9, 1711, LENGTH - 1]  # physical, after each row's left padding
    start = [5, 9, 0, 0]  # rows 0 and 1: the last trivial and the first non-trivial context, left padded
    if align == 32:
        cur_pos[1] = start[1] + 2 * WINDOW  # the first context over 2S, where the aligned window differs most
    q = torch.randn(len(cur_pos), HQ, DIM, generator=generator)
    k = torch.randn(len(cur_pos), HKV, LENGTH, DIM, generator=generator)
    v = torch.randn(len(cur_pos), HKV, LENGTH, DIM, generator=generator)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), cur_pos, start


# on a GPU every dtype with every alignment; in the interpreter (about a minute a float32 case) each dtype and each
# alignment once
CASES = ([(dtype, align) for dtype in DTYPES for align in (1, 32)] if DEVICE == "cuda"
         else [(torch.float32, 1), (torch.float16, 32)])


@pytest.mark.parametrize(("dtype", "align"), CASES)
def test_both_kernels_equal_a_float64_oracle_at_llama3_8b_heads(dtype: torch.dtype, align: int) -> None:
    q, k, v, cur_pos, start = _inputs(dtype, align)
    q64, k64, v64 = (x.cpu().double() for x in (q, k, v))
    oracle = decode_step_float64(q64, k64, v64, cur_pos, start, WINDOW, align, 1.0)
    ratio = (oracle["d"] / oracle["n"]).tolist()
    margin = MARGIN[dtype]

    def above(r: float) -> float:  # accepts a row of ratio r, beyond the margin by construction
        return 1.5 * r + 2 * margin

    def below(r: float) -> float:  # rejects it (r > 3 margin), beyond the margin by construction
        return r / 1.5 - margin

    # per row: accept (trivial), accept, reject, accept; the row to reject is the one of the largest ratio
    rejected = max((1, 2, 3), key=lambda b: ratio[b])
    assert ratio[rejected] > 3 * margin
    lambdas = [float("inf"), *(below(ratio[b]) if b == rejected else above(ratio[b]) for b in (1, 2, 3))]
    # one lambda for every row: the middle of the widest gap between ratios (the trivial row's 0 among them), which
    # accepts the rows below it and rejects those above; and one above every ratio, which accepts all
    points = sorted([0.0, *ratio[1:]])
    gap, middle = max((b - a, (a + b) / 2) for a, b in zip(points, points[1:]))
    assert gap > 2 * margin
    scalars = [middle, above(max(ratio[1:]))]
    for lam in (*scalars, torch.tensor(lambdas)):  # a scalar, and one lambda per row
        out = triton_decode.speculative_flash_decode_triton(
            q, k, v, torch.tensor(cur_pos, device=DEVICE), WINDOW, lam if isinstance(lam, float) else lam.to(DEVICE),
            window_align=align, start=torch.tensor(start, device=DEVICE))
        out = type(out)(*(x.cpu() for x in out))
        want = decode_step_float64(q64, k64, v64, cur_pos, start, WINDOW, align,
                                   lam if isinstance(lam, float) else lam.tolist())
        for name in ("exact", "spec"):
            error = (getattr(out, name).double() - want[name]).flatten(1).norm(dim=1) / want[name].flatten(1).norm(dim=1)
            assert error.max() < TOLERANCE[dtype], (name, error)
        torch.testing.assert_close(out.d.double(), want["d"], rtol=D_RTOL[dtype], atol=1e-6)
        torch.testing.assert_close(out.n.double(), want["n"], rtol=TOLERANCE[dtype], atol=0)
        assert out.trivial.tolist() == want["trivial"] == [True, False, False, False]
        rows = decisions_away_from_boundary(want["d"], want["n"], lam if isinstance(lam, float) else lam.tolist(),
                                            margin=margin)
        assert len(rows) == 4
        assert [out.accept.tolist()[b] for b in rows] == [want["accept"][b] for b in rows]
    assert want["accept"] == [b != rejected for b in range(4)]
