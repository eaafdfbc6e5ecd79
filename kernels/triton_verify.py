"""A~ over vLLM's paged KV cache on CUDA: the verifier's half of the paged decode kernel (:mod:`.triton_paged`),
without A. vLLM's own attention has written A; this kernel reads each verified row's draft keys (ranges fixed by
position, ``Approximation.position_ranges``) through the block table, in place, and returns A~. d, n, the decision
and the commit are :mod:`alspec_eval.semantics`' (``alspec_eval.vllm.verifiers.verify_layer``), so lambda 0 and exact
layers stay plain vLLM bit for bit.

Decode rows and multi-token rows (prefill chunks, teacher-forced scoring) alike: a row is (token, batch row,
position, ranges). The cache is any (num_blocks, Hkv, N, D) view whose head_dim is contiguous (the K and V halves
of vLLM's (num_blocks, Hkv, N, 2D) per-layer view in every ``KVCacheLayout``: the strides carry the layout). No
host read-back, no gathered copy: one launch per layer.

Triton's interpreter runs it on the CPU (``TRITON_INTERPRET=1``, how the tests check it); its bfloat16 ``tl.dot`` is
wrong there, so bfloat16 is proved by compiling it for the GPU targets (``python -m
alspec_eval.kernels.triton_launch --kernel verify``).
"""

from __future__ import annotations

import torch

from .triton_launch import VERIFY_LAUNCH, kernel, verify_constexprs


def check_verify_inputs(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        block_table: torch.Tensor) -> None:
    """Refuse what the kernel would misread (it indexes blindly)."""
    if query.dim() != 3 or keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"expected query (tokens, Hq, D) and keys, values (num_blocks, Hkv, N, D); got "
                         f"{tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    if keys.shape[3] != query.shape[2] or query.shape[1] % keys.shape[1]:
        raise ValueError(f"query {tuple(query.shape)} does not match the cache {tuple(keys.shape)} "
                         "(grouped-query attention needs Hq % Hkv == 0)")
    if keys.stride(3) != 1 or values.stride(3) != 1 or query.stride(2) != 1:
        raise ValueError("the paged verifier reads a key's head_dim at once: it must be contiguous (stride 1) in the "
                         f"query {query.stride()}, keys {keys.stride()} and values {values.stride()}")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be (requests, max_blocks), got {tuple(block_table.shape)}")


def paged_approximation(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_table: torch.Tensor,
                        token: torch.Tensor, request: torch.Tensor, pos: torch.Tensor, starts: torch.Tensor,
                        ends: torch.Tensor, scale: float) -> torch.Tensor:
    """A~ (rows, Hq, D) in the query's dtype of the rows (``token`` into ``query``'s first dimension, ``request``
    into the block table's, ``pos`` their logical position; ``starts``, ``ends`` (rows, K) their key ranges, cut to
    [0, pos] here): :func:`alspec_eval.semantics.attend` over those keys, to float32 rounding."""
    check_verify_inputs(query, keys, values, block_table)
    rows, (_, heads, dim) = len(token), query.shape
    kv_heads, page = keys.shape[1], keys.shape[2]
    out = torch.empty(rows, heads, dim, dtype=torch.float32, device=query.device)
    if not rows:
        return out.to(query.dtype)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    starts, ends = starts.contiguous(), ends.contiguous()
    kernel("verify")[(rows, kv_heads)](
        query, keys, values, block_table, token, request, starts, ends, pos, out, query.stride(0), query.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        block_table.stride(0), scale, starts.shape[1], heads // kv_heads,
        **verify_constexprs(query.dtype, heads // kv_heads, dim, page), num_stages=VERIFY_LAUNCH.num_stages,
        num_warps=VERIFY_LAUNCH.num_warps)
    return out.to(query.dtype)
