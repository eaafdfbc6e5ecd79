"""On a CUDA GPU (skipped without one): the Triton speculative decode against the torch reference in float16 and
bfloat16 (GQA, left padding, window_align 1 and 32), and `--model alspec` in bfloat16 with kernel=auto (Triton)
deciding as kernel=model except within bfloat16 rounding of lambda; KeyDiff's scores as kvpress's own call there (the
GPU's branch reads no flag back). The wall-time ratio is a benchmark:
`python benchmarks/bench_adapter.py --device cuda --dtype bfloat16 --kernel auto` (and `--kernel sdpa`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.filterwarnings("ignore")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("align,window", [(1, 16), (32, 32)])
def test_triton_matches_reference_with_gqa_and_left_padding(dtype, align, window):
    pytest.importorskip("triton")
    from alspec_eval.kernels import speculative_flash_decode
    from alspec_eval.kernels.triton_decode import speculative_flash_decode_triton

    torch.manual_seed(0)
    start = torch.tensor([0, 7, 40, 3], device="cuda")
    cur_pos = start + torch.tensor([500, 31, 200, 2 * window + 1], device="cuda")
    q = torch.randn(4, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(4, 8, 600, 128, device="cuda", dtype=dtype)
    v = torch.randn(4, 8, 600, 128, device="cuda", dtype=dtype)
    ref = speculative_flash_decode(q.float(), k.float(), v.float(), cur_pos, window, 0.3, window_align=align,
                                   start=start)
    out = speculative_flash_decode_triton(q, k, v, cur_pos, window, 0.3, window_align=align, start=start)
    torch.testing.assert_close(out.exact.float(), ref.exact, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.spec.float(), ref.spec, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.d / out.n, ref.d / ref.n, atol=1e-2, rtol=2e-2)
    assert torch.equal(out.trivial, ref.trivial)


@pytest.mark.slow  # builds a model
def test_alspec_on_cuda_bfloat16_triton_decides_as_sdpa():
    pytest.importorskip("triton")
    from alspec_eval.region import DecodeRegion
    from helpers import PROMPTS, TOKENIZER, alspec_lm
    from alspec_eval.approx_check.models import tiny_model

    model = tiny_model().to("cuda", torch.bfloat16)
    ids = torch.tensor([TOKENIZER(PROMPTS[0] * 3)["input_ids"]], device="cuda")
    traces = {}
    for kernel in ("model", "auto"):
        lm = alspec_lm(model, window=16, kernel=kernel, device="cuda", **{"lambda": 0.3})
        assert (lm.speculator.decode_kernel is None) == (kernel == "model")
        with torch.no_grad():
            out = lm.model.generate(ids[:, :-20], max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
            cache = out.past_key_values
            with lm.speculator.speculating(DecodeRegion.build([0], [ids.shape[1] - 20], device="cuda"), lm.spec_config) as trace:
                for t in range(ids.shape[1] - 20, ids.shape[1]):  # teacher-forced decode steps, one token each
                    lm.model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        traces[kernel] = trace
    a, b = traces["model"], traces["auto"]
    codes_a, codes_b = a.codes[0].flatten(), b.codes[0].flatten()  # (position, layer) in decoding order
    ratios_a, ratios_b = a.ratios[0].flatten(), b.ratios[0].flatten()
    differ = (codes_a != codes_b).nonzero().flatten()
    upto = int(differ[0]) if len(differ) else len(codes_a)
    # Up to the first differing decision both kernels saw the same states; that decision sat on the threshold.
    same = ~torch.isnan(ratios_a[:upto])
    assert same.sum() > 10
    torch.testing.assert_close(ratios_b[:upto][same], ratios_a[:upto][same], atol=1e-2, rtol=2e-2)
    if len(differ):
        assert abs(float(ratios_a[upto]) - 0.3) <= 0.02 * 0.3, "a decision away from lambda differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keydiff_scores_on_the_gpu_are_kvpress_s_own_call(dtype):
    """Off the CPU KeyDiff's draft makes F.normalize's unit keys apart whether or not a key is shorter than the
    cosine's eps (no flag read back): still bit for bit the press's call on the GPU, with and without such keys."""
    from alspec_eval.approximations import kvpress as drafts, make_approximation

    approx = make_approximation("kvpress:KeyDiffPress")
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (1, 17, 4099):
        keys = (3 * torch.randn(1, 4, n + 5, 128, generator=g, device="cuda")).to(dtype)[:, :, 5:]
        for short in (False, True):
            if short and n > 3:
                keys = keys.clone()
                keys[0, 0, 1], keys[0, 1, 2] = 0, keys[0, 1, 2] * 1e-10
            want = drafts.score(approx.make_press(8, n), None, None, keys, None, {})[0]
            assert torch.equal(approx.row_scores(keys, None, 4, None, None), want), (dtype, n, short)
