"""Blocks that hold speculated positions, keyed in vLLM's prefix cache by the rules that computed them.

vLLM keys a cached block by its tokens and its parent's key, and caches full blocks of generated tokens as well as
prompt blocks. A block whose positions all come before a request's speculation start holds exact KV entries (by
causality nothing speculated reaches them), and is shared with every request. A block that holds a speculated
position (a loglikelihood continuation, ``speculate_prefill``, a generated token fed back) is keyed also by the
request's rules and where its speculation starts, so it serves only a request that computes it alike; every block
after it differs through its parent. The driver puts both in the request's tag (``SamplingParams.extra_args``).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

TAG = "alspec"  # the key of SamplingParams.extra_args: [speculation start, request id, salt of the rules or None,
# first position of a prompt-scoring draft's observation window or None, the request's seed (semantics.request_seed),
# the digest of its prompt (prompt_digest) or None, whether every worker holds that prompt's observation]


def prompt_digest(tokens: list[int], start: int) -> int:
    """What a prompt-scoring draft's observation of a prompt is kept under across calls: BLAKE2b (64 bits, 63 kept)
    of the speculation start and the tokens the observation reads (those before the start, at least the first), each
    as 8 bytes little-endian signed (a CRC-32, as the request seed is, would let two of a few thousand prompts share
    one; an empty prompt and a one-token prompt read the same token and observe apart)."""
    read = [start, *tokens[:max(start, 1)]]
    packed = struct.pack(f"<{len(read)}q", *map(int, read))
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") & (2**63 - 1)


def speculated_block_key(request: Any, start_token: int, end_token: int) -> tuple | None:
    """The extra key of the block of ``request`` over [start_token, end_token): the request's own id where the block
    holds a position whose query a prompt-scoring draft must read in this call (its observation window: the prefill
    must run, unless every worker holds the prompt's observation from an earlier call), else its rules and
    speculation start where it holds a speculated position under rules that can change a KV entry, else None."""
    params = getattr(request, "sampling_params", None)
    args = getattr(params, "extra_args", None) or {}
    tag = args.get(TAG)
    if not tag:
        return None
    held = len(tag) > 6 and bool(tag[6])
    if len(tag) > 3 and tag[3] is not None and end_token > tag[3] and not held:
        return (TAG, "observed", int(tag[1]))
    if len(tag) < 3 or tag[2] is None or end_token <= tag[0]:
        return None
    return (TAG, str(tag[2]), int(tag[0]))


def install() -> None:
    """Add :func:`speculated_block_key` to vLLM's extra keys of a block hash, in this process (the engine core
    hashes the blocks); the KV events' copy of the function too, so that events name the same keys."""
    from vllm.v1.core import block_pool, kv_cache_utils

    original = kv_cache_utils.generate_block_hash_extra_keys
    if getattr(original, "_alspec", False):
        return

    def generate_block_hash_extra_keys(request: Any, start_token_idx: int, end_token_idx: int,
                                       start_mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
        keys, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        ours = speculated_block_key(request, start_token_idx, end_token_idx)
        return (keys if ours is None else (*(keys or ()), ours)), next_mm_idx

    generate_block_hash_extra_keys._alspec = True  # type: ignore[attr-defined]
    generate_block_hash_extra_keys.__wrapped__ = original  # type: ignore[attr-defined]
    for module in (kv_cache_utils, block_pool):
        if getattr(module, "generate_block_hash_extra_keys", None) is original:
            module.generate_block_hash_extra_keys = generate_block_hash_extra_keys
