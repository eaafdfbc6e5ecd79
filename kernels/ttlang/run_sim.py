"""Run the TT-Lang kernel on tt-lang-sim and compare it with the torch reference.

Usage (repository root, simulator env): python -m alspec_eval.kernels.ttlang.run_sim [--json]
Prints PCCs of exact and speculative outputs (bf16 inputs) and the accept
decisions of kernel and reference at lambdas around each measured ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

BF16 = torch.bfloat16  # tt-lang-sim rebinds torch.bfloat16 to float32 when it loads

from ..reference import speculative_flash_decode


def pcc(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])


def run(cur_pos: list[int], hq: int, hkv: int, dim: int, cache_len: int, window: int, seed: int = 0) -> dict:
    """Kernel vs reference on random bf16 inputs; garbage past cur_pos is large and must be ignored."""
    g = torch.Generator().manual_seed(seed)
    b = len(cur_pos)
    q = torch.randn(b, hq, dim, generator=g).to(BF16)
    k = torch.randn(b, hkv, cache_len, dim, generator=g)
    v = torch.randn(b, hkv, cache_len, dim, generator=g)
    for i, p in enumerate(cur_pos):
        k[i, :, p + 1 :] = 50.0
        v[i, :, p + 1 :] = -100.0
    k, v = k.to(BF16), v.to(BF16)
    pos = torch.tensor(cur_pos)
    ref = speculative_flash_decode(q, k, v, pos, window, 0.0, window_align=32)

    from .decode import SIM, flavour, load_ttnn, ttlang_decode

    if flavour() != SIM:
        raise SystemExit("run_sim needs tt-lang-sim (pip install tt-lang-sim)")
    ttnn = load_ttnn()
    device = ttnn.open_device(device_id=0)
    try:
        exact, spec, d2, n2 = ttlang_decode(q, k, v, cur_pos, window, dim**-0.5, device)
    finally:
        ttnn.close_device(device)

    ratio = (ref.d / ref.n).tolist()
    decisions = []
    for r in ratio:
        for lam in (r * 0.99, r * 1.01):
            decisions.append({
                "lam": lam,
                "kernel": [bool(x) for x in (d2 <= lam * lam * n2) | ref.trivial],
                "reference": speculative_flash_decode(q, k, v, pos, window, lam, window_align=32).accept.tolist(),
            })
    return {
        "pcc_exact": pcc(exact, ref.exact.float()),
        "pcc_spec": pcc(spec, ref.spec.float()),
        "max_abs_exact": float((exact - ref.exact.float()).abs().max()),
        "max_abs_spec": float((spec - ref.spec.float()).abs().max()),
        "d_kernel": d2.sqrt().tolist(),
        "d_reference": ref.d.tolist(),
        "n_kernel": n2.sqrt().tolist(),
        "n_reference": ref.n.tolist(),
        "trivial": ref.trivial.tolist(),
        "decisions": decisions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    # Per-sequence positions: deep, tile-unaligned (masked tail), trivial (fits in 2S).
    result = run(cur_pos=[300, 170, 50], hq=6, hkv=2, dim=64, cache_len=320, window=32)
    if args.json:
        json.dump(result, sys.stdout)
    else:
        for key, val in result.items():
            if key != "decisions":
                print(f"{key}: {val}")
        agree = all(d["kernel"] == d["reference"] for d in result["decisions"])
        print(f"accept decisions agree at {len(result['decisions'])} lambdas: {agree}")
    if not all(math.isfinite(x) for x in (result["pcc_exact"], result["pcc_spec"])):
        sys.exit(1)


if __name__ == "__main__":
    main()
