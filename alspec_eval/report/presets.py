"""Built-in latency tables for ``alspec-report --preset``.

NOT THE PAPER'S NUMBERS. The measured N150 per-layer latencies of the paper's Appendix F could not
be retrieved (only its first page was reachable), so these are illustrative back-of-envelope
values for Llama-3.1-8B decode on one Tenstorrent Wormhole N150, assuming reads of bfp8 weights
(~0.22 GB per layer) and KV cache (8 KV heads x 128 x 2 x 1 byte per token and layer) at an
effective ~250 GB/s, and ~20 µs for the speculative kernel's first partial result (2S = 256
tokens). Replace them with measured numbers via ``--latency FILE`` (same fields as below).
"""

from __future__ import annotations

from alspec_eval.report.latency import LatencySpec

_LAYERS = 32  # Llama-3.1-8B
_NOTE = "ILLUSTRATIVE estimate (bandwidth model), not measured and not the paper's Appendix F numbers"


def _llama8b_n150(context: str, attention_us: float) -> LatencySpec:
    return LatencySpec(
        name=f"example-llama8b-n150-{context}",
        non_attention_us=(900.0,) * _LAYERS,
        attention_us=(attention_us,) * _LAYERS,
        speculative_us=(20.0,) * _LAYERS,
        miss_overhead_us=0.0,
        description=f"Llama-3.1-8B, N150, {context} context; {_NOTE}",
    )


PRESETS: dict[str, LatencySpec] = {
    spec.name: spec for spec in (_llama8b_n150("32k", 270.0), _llama8b_n150("128k", 1070.0))
}
