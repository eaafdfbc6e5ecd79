"""The model-family matrix: tiny random configs of every decoder family people evaluate, each set to exercise what
is special about its attention (built by models.build). The family table of docs/models.md is rendered from FAMILIES
(tests/test_families.py checks that it is); CONTRACT is the three alspec-check-approx runs on."""

from __future__ import annotations

from .models import ARCHS, Family

SLIDING = 16  # a sliding window shorter than the prompts (PROMPTS are 8 to 80 characters, one token each)
ALTERNATING = ["sliding_attention", "full_attention"] * 2

FAMILIES = [
    Family("Llama 3", "LlamaConfig", "LlamaForCausalLM", "Llama 3 RoPE scaling (rope_type llama3, factor 8)", "exact",
           {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", "biases on q, k, v", "exact"),
    Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", "q/k RMS norms; head_dim 24, not hidden/heads = 16", "exact",
           {"head_dim": 24}),
    Family("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "mixture-of-experts MLP under Qwen3 attention",
           "exact", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}),
    Family("Mistral (window)", "MistralConfig", "MistralForCausalLM",
           f"sliding window of {SLIDING} on every layer, shorter than the prompts",
           "exact; every layer reported as not speculated (sliding window); policy=selfspec refused",
           {"sliding_window": SLIDING}, sliding_layers=(0, 1, 2, 3)),
    Family("Gemma 2", "Gemma2Config", "Gemma2ForCausalLM",
           "attention logit soft-capping (50); query_pre_attn_scalar 64, not head_dim; alternating sliding-window "
           "layers", "exact (eager attention: soft-capping is the model's own attention function, called on the "
           "window); sliding layers not speculated; policy=selfspec and fused kernels refused",
           {"head_dim": 16, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "sliding_window": SLIDING, "layer_types": ALTERNATING}, attn="eager", sliding_layers=(0, 2)),
    Family("Gemma 3 (text)", "Gemma3TextConfig", "Gemma3ForCausalLM",
           "q/k norms; query_pre_attn_scalar 64; alternating sliding-window layers with their own RoPE base",
           "exact; sliding layers not speculated; policy=selfspec refused",
           {"head_dim": 16, "query_pre_attn_scalar": 64, "sliding_window": SLIDING, "layer_types": ALTERNATING,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
           sliding_layers=(0, 2)),
    Family("Phi-3", "Phi3Config", "Phi3ForCausalLM", "fused qkv projection", "exact"),
    Family("OLMo 2", "Olmo2Config", "Olmo2ForCausalLM", "q/k RMS norms over all heads", "exact"),
    Family("Granite", "GraniteConfig", "GraniteForCausalLM", "attention_multiplier 0.05 as the scaling, not "
           "1/sqrt(head_dim)", "exact", {"attention_multiplier": 0.05, "embedding_multiplier": 2.0,
                                         "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    Family("gpt-oss", "GptOssConfig", "GptOssForCausalLM",
           "learned per-head attention sinks; alternating sliding-window layers; mixture of experts",
           "exact (eager attention: the sinks are the model's own attention function, called on the window); "
           "sliding layers not speculated; policy=selfspec and fused kernels refused",
           {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": SLIDING,
            "layer_types": ALTERNATING}, attn="eager", sliding_layers=(0, 2)),
]

BY_NAME = {f.name: f for f in FAMILIES}
# where an approximation could go wrong: llama's grouped-query heads, qwen2's q/k/v biases, gemma2's logit
# soft-capping, eager attention and sliding-window layers that are not speculated
CONTRACT = {"llama": ARCHS["llama"], "qwen2": BY_NAME["Qwen2"], "gemma2": BY_NAME["Gemma 2"]}


def table_markdown() -> str:
    """The family table of docs/models.md."""
    lines = ["| family | what is special about its attention | status |", "| --- | --- | --- |"]
    lines += [f"| {f.name} | {f.special} | {f.status} |" for f in FAMILIES]
    return "\n".join(lines) + "\n"
