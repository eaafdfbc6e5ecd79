"""The speculating backends are registered, not patched: the plugin registers each over the name of the vLLM
backend it wraps (vLLM's ``register_backend``), in alspec-vllm's engines only, and each is that backend with the
speculating impl and a builder that never asks for full CUDA graphs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow  # importing vLLM's backends starts a process (the tiers' guard, tests/conftest.py)


@pytest.fixture
def registry(monkeypatch):
    """vLLM's registry of backend overrides, put back after the test."""
    from vllm.v1.attention.backends import registry

    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", {})
    return registry


def test_the_plugin_registers_every_wrapped_backend_in_alspec_engines_only(registry, monkeypatch):
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import AttentionCGSupport

    from alspec_eval.vllm import plugin
    from alspec_eval.vllm.backend import SpeculatingImpl
    from alspec_eval.vllm.paged import BACKENDS

    monkeypatch.delenv(plugin.ENGINE_FLAG, raising=False)
    plugin.register()  # a plain engine in the same environment
    assert not any(registry.AttentionBackendEnum[name].is_overridden() for name in BACKENDS)
    monkeypatch.setenv(plugin.ENGINE_FLAG, "1")
    monkeypatch.setattr("alspec_eval.vllm.prefix_cache.install", lambda: None)  # tested on its own
    plugin.register()
    assert set(BACKENDS) >= {"CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"}
    for name in BACKENDS:
        member = registry.AttentionBackendEnum[name]
        ours = member.get_class()
        base = ours.__mro__[2]  # after Speculating
        assert base.__module__.startswith("vllm.") and ours.get_name() == base.get_name() == name
        assert issubclass(ours.get_impl_cls(), SpeculatingImpl) and issubclass(ours.get_impl_cls(), base.get_impl_cls())
        assert ours.get_impl_cls().forward is SpeculatingImpl.forward
        assert issubclass(ours.get_builder_cls(), base.get_builder_cls())
        assert ours.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.NEVER
    # the CPU platform's own choice, whatever attention_backend says, is now the speculating CPU_ATTN
    chosen = current_platform.get_attn_backend_cls(None, _selector(), num_heads=4)
    assert chosen == registry.AttentionBackendEnum.CPU_ATTN.get_path()
    assert chosen == f"alspec_eval.vllm.backends.{BACKENDS['CPU_ATTN'].wrapper}"


def _selector():
    """What vLLM's selector hands the platform for a float32 decoder (no MLA, no sparsity)."""
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=32)


def _hashes(tag: list | None) -> list:
    """vLLM's block hashes of a 96-token request in blocks of 32, with ``tag`` as its alspec extra argument."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from alspec_eval.vllm.prefix_cache import TAG

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1, extra_args=None if tag is None else {TAG: tag})
    request = Request("r", list(range(96)), params, None, block_hasher=get_request_block_hasher(32, sha256))
    return list(request.block_hashes)


def test_the_block_hash_patch_keys_speculated_blocks_in_vllms_own_hasher(monkeypatch):
    """The one vLLM function alspec-vllm still patches (no public point adds keys to a block's hash): after install,
    vLLM's own request block hasher gives a block from the speculation start on (64 here) a hash of its rules, in
    the scheduler's and the block pool's copy alike, and leaves exact blocks and untagged requests as vLLM hashes
    them; installing twice changes nothing."""
    from vllm.v1.core import block_pool, kv_cache_utils

    from alspec_eval.vllm.prefix_cache import install

    # vLLM's own function (an engine of this process may have installed the patch), put back after the test
    original = getattr(kv_cache_utils.generate_block_hash_extra_keys, "__wrapped__",
                       kv_cache_utils.generate_block_hash_extra_keys)
    for module in (kv_cache_utils, block_pool):
        monkeypatch.setattr(module, "generate_block_hash_extra_keys", original)
    plain, before = _hashes(None), _hashes([64, 7, "rules"])
    assert plain == before  # vLLM's own hasher ignores extra_args
    install()
    install()
    assert block_pool.generate_block_hash_extra_keys is kv_cache_utils.generate_block_hash_extra_keys
    assert _hashes(None) == plain
    ours, other_rules, other_start = _hashes([64, 7, "rules"]), _hashes([64, 8, "other"]), _hashes([33, 7, "rules"])
    assert ours[:2] == plain[:2] and ours[2] != plain[2]  # blocks 0-63 exact and shared; the block from 64 keyed
    assert other_rules[:2] == plain[:2] and other_rules[2] not in (ours[2], plain[2])
    assert other_start[0] == plain[0] and other_start[1] not in (ours[1], plain[1])


def _common(query_start_loc: list[int], seq_lens: list[int]):
    """vLLM's own CommonAttentionMetadata of a step, host copies and device tensors alike (on the CPU)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl, lens = torch.tensor(query_start_loc, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, num_reqs=len(lens),
                                   num_actual_tokens=int(qsl[-1]), max_query_len=int((qsl[1:] - qsl[:-1]).max()),
                                   max_seq_len=int(lens.max()), block_table_tensor=torch.zeros(len(lens), 4),
                                   slot_mapping=torch.zeros(int(qsl[-1])), seq_lens_cpu_upper_bound=lens)


def test_the_builder_attaches_the_step_built_from_what_vllm_gives_it(monkeypatch):
    """The speculating builder builds the step's rows once, from vLLM's CommonAttentionMetadata (host copies) and the
    requests' tags, and attaches them to the backend's own metadata, through the state the worker extension handed
    its layers' impls; before the driver configures the engine it attaches None. The runner state the one adapter reads (``input_batch.req_ids``, each request's
    ``sampling_params`` and ``num_prompt_tokens``) is asserted on vLLM's own classes, so a vLLM that renames it fails
    here, not silently in an engine."""
    import dataclasses
    import inspect
    from types import SimpleNamespace

    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    from unittest.mock import Mock

    from vllm.model_executor.layers.attention import Attention

    from alspec_eval.vllm import backend, backends
    from alspec_eval.vllm.prefix_cache import TAG
    from alspec_eval.vllm.worker import ALSpecWorker

    assert isinstance(inspect.getattr_static(InputBatch, "req_ids"), property)
    assert "sampling_params" in {f.name for f in dataclasses.fields(CachedRequestState)}
    assert "self.num_prompt_tokens" in inspect.getsource(CachedRequestState.__post_init__)

    class Base:
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return SimpleNamespace(built=common_attn_metadata.num_reqs)

    class Builder(backends.SpeculatingBuilder, Base):
        pass

    def request(start: int, tag: int, prompt: int, seed: int):
        return SimpleNamespace(sampling_params=SamplingParams(extra_args={TAG: [start, tag, None, None, seed]}),
                               num_prompt_tokens=prompt)

    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b"]),
                             requests={"a": request(3, 7, 5, 2**32 - 1), "b": request(6, 8, 6, 11)})
    impl = type("Impl", (backend.SpeculatingImpl,), {})()
    layer = Mock(spec=Attention, impl=impl, attn_backend=SimpleNamespace(get_name=lambda: "CPU_ATTN"))
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={"model.layers.0.attn": layer}),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1))
    worker = type("Worker", (ALSpecWorker,), {"device": torch.device("cuda"), "model_runner": runner,
                                              "vllm_config": config})()
    builder = Builder()
    builder.vllm_config, builder.layer_names = config, ["model.layers.0.attn"]
    common = _common([0, 5, 6], [5, 9])  # a 5-token prompt, and a decode step at position 8
    assert builder.build(0, common).alspec is None  # not configured yet
    worker.alspec_configure({"approx": "sink", "approx_args": {}, "thresholds": [0.5], "window": 8,
                             "window_align": 1, "check_layout": False})
    built = builder.build(0, common)
    assert built.built == 2
    rows = built.alspec.rows
    assert rows.token.tolist() == [3, 4, 5] and rows.pos.tolist() == [3, 4, 8] and rows.tag.tolist() == [7, 7, 8]
    assert rows.prompt.tolist() == [True, True, False]
    assert rows.seed.tolist() == [2**32 - 1, 2**32 - 1, 11]  # each request's seed, from its tag
    assert torch.equal(built.alspec.seq_lens, common.seq_lens_cpu_upper_bound)
    monkeypatch.setattr(common, "seq_lens_cpu_upper_bound", None)
    with pytest.raises(RuntimeError, match="seq_lens_cpu_upper_bound"):
        builder.build(0, common)
