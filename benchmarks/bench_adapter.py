"""Wall time of `--model alspec` (sim backend) against the stock `--model hf` on the same generation work.

Prompts of about 2K tokens cut from the bundled haystack, 64 new tokens each (no stop sequence),
lambda 0.1, window 64, through lm-eval's own generate_until. Runs alternate between the models
(all resident) and the medians of the rounds are compared. Prints the ratio alspec / hf per
batch size (target: at most 1.10) and, on CUDA, the GPU (kernel) time per new token.

The model: the embedded SmolLM2-135M (``--shape smollm2``), or a Llama-3-8B shape with random weights
in bfloat16 built from its config (``--shape llama3-8b``; no weights to download: time and memory do
not depend on them; ``--layers`` shrinks it for a smoke run).

    python benchmarks/bench_adapter.py [--prompts 4] [--repeats 3] [--tokens 2048] [--batch-sizes 1]
    python benchmarks/bench_adapter.py --device cuda --shape llama3-8b --prompts 8 --batch-sizes 1,8 \
        --kernels auto,model --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib import resources

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from alspec_eval.adapter import ALSpecLM
from alspec_eval.hooks import remove
from alspec_eval.smollm2 import smollm2_path


def prompts(tokenizer, count: int, tokens: int) -> list[str]:
    haystack = (resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8")
    ids = tokenizer(haystack)["input_ids"]
    step = len(ids) // count
    return [tokenizer.decode(ids[i * step:i * step + tokens]) for i in range(count)]


def requests(texts: list[str], new_tokens: int) -> list[Instance]:
    kwargs = {"until": [], "max_gen_toks": new_tokens, "do_sample": False}
    return [Instance("generate_until", {}, (t, dict(kwargs)), i, ("bench", i, 1)) for i, t in enumerate(texts)]


def timed(lm: HFLM, texts: list[str], new_tokens: int) -> float:
    if lm.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    lm.generate_until(requests(texts, new_tokens), disable_tqdm=True)
    if lm.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def gpu_ms_per_token(lm: HFLM, texts: list[str], new_tokens: int) -> float:
    """GPU (kernel) time of one generate_until call per new token of the batch, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed(lm, texts, new_tokens)
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    return kernel_us / 1e3 / new_tokens


def llama3_8b(device: str, layers: int | None) -> torch.nn.Module:
    """Llama-3-8B's shape with random weights, built on ``device`` in bfloat16 (no download)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers or 32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192,
        attn_implementation="sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,8")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=["smollm2", "llama3-8b"], default="smollm2")
    parser.add_argument("--layers", type=int, default=None, help="llama3-8b only: fewer layers, for a smoke run")
    parser.add_argument("--kernels", default="model,torch",
                        help="alspec's decode kernels to time, comma-separated: auto, model, torch, triton")
    parser.add_argument("--dtype", default="float32", help="smollm2's dtype, e.g. bfloat16 on CUDA")
    args = parser.parse_args()

    path = str(smollm2_path())  # its tokenizer serves the random model too (its ids are within 128256)
    names = ["hf", *args.kernels.split(",")]
    dtype = "bfloat16" if args.shape == "llama3-8b" else args.dtype
    # one resident model per runner (alspec's hooks stay on theirs), so hf runs the plain model
    instances = {name: llama3_8b(args.device, args.layers) for name in names} if args.shape == "llama3-8b" else {}
    print(f"device={args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}) "
          f"threads={torch.get_num_threads()} torch {torch.__version__} shape={args.shape} dtype={dtype} "
          f"prompts={args.prompts}x{args.tokens} tokens new={args.new_tokens}, medians of {args.repeats} "
          "interleaved rounds")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        models: dict[str, HFLM] = {}
        for name in names:
            common = ({"pretrained": instances[name], "tokenizer": path} if instances else
                      {"pretrained": path, "dtype": dtype}) | {"device": args.device, "batch_size": batch}
            models[name] = HFLM(**common) if name == "hf" else ALSpecLM(
                **common, **{"lambda": 0.1, "window": 64, "kernel": name})
        texts = prompts(models["hf"].tokenizer, args.prompts, args.tokens)
        for lm in models.values():
            timed(lm, texts[:1], 4)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.repeats):  # interleaved rounds
            for name, lm in models.items():
                times[name].append(timed(lm, texts, args.new_tokens))
        medians = {name: statistics.median(t) for name, t in times.items()}
        gpu = ({name: gpu_ms_per_token(lm, texts[:batch], args.new_tokens) for name, lm in models.items()}
               if args.device == "cuda" else {})
        print(f"batch {batch}")
        for name, lm in models.items():
            line = f"  {'hf' if name == 'hf' else 'alspec ' + name:16s} median {medians[name]:.2f} s  runs " \
                   f"{[round(t, 2) for t in times[name]]}"
            if name != "hf":
                hit = lm.statistics()["tasks"]["bench"]["total"]["hit_rate"]
                line += f"  hit rate {hit:.3f}  ratio alspec/hf = {medians[name] / medians['hf']:.3f}"
            if gpu:
                line += f"  GPU {gpu[name]:.1f} ms per token"
            print(line)
        for name, model in instances.items():
            if name != "hf":
                remove(model)  # the next batch size's wrapper installs its own


if __name__ == "__main__":
    main()
