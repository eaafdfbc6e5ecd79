"""Installing and removing the speculator (kvpress-style), and what importing the package leaves alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alspec_eval import _lmeval_hook, compat
from alspec_eval.approx_check.models import tiny_model
from alspec_eval.config import ConfigError, SpeculationConfig
from alspec_eval.hooks import ATTR, install, remove, speculation
from alspec_eval.region import DecodeRegion

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_speculation_block_installs_and_removes_everything():
    model = tiny_model()
    ids = torch.randint(3, 100, (1, 60))
    with torch.no_grad():
        before = model(ids).logits
        with speculation(model) as speculator:
            assert model.config._attn_implementation == "alspec_sdpa"
            with speculator.speculating(DecodeRegion.build([0], [30]), SpeculationConfig(policy="always", window=8)):
                sink = model(ids).logits
            with pytest.raises(RuntimeError, match="already speculates"):
                install(model)
        after = model(ids).logits
    assert not torch.equal(sink, before)  # speculation did act inside the block
    assert torch.equal(after, before)
    assert model.config._attn_implementation == "sdpa"
    assert not model._forward_pre_hooks
    assert not any(hasattr(m, ATTR) for m in model.modules())
    remove(model)  # a second remove is a no-op


@pytest.mark.slow
def test_import_changes_no_global_state():
    code = ("import sys; hook = sys.excepthook; import alspec_eval.adapter, alspec_eval.backends.sim; "
            "assert sys.excepthook is hook, 'excepthook replaced on import'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.slow
def test_top_level_kernels_folder_is_harmless_from_the_repository_root():
    """From the root `kernels/` is also a top-level name, which transformers probes for the PyPI `kernels`."""
    code = ("import kernels, transformers.integrations.hub_kernels as h; "
            "assert not hasattr(kernels, '__version__'); "
            "from alspec_eval.kernels import speculative_flash_decode")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


class _Registry(dict):
    """lm-eval's Registry with one of the two spellings of its lazy placeholder keyword."""

    def __init__(self, keyword: str | None) -> None:
        super().__init__()
        self.keyword = keyword
        if keyword == "target":
            self.register = lambda *names, target=None: self.update(dict.fromkeys(names, target))
        elif keyword == "lazy":
            self.register = lambda *names, lazy=None: self.update(dict.fromkeys(names, lazy))
        else:
            self.register = lambda *names, obj=None: self.update(dict.fromkeys(names, obj))


@pytest.mark.parametrize("keyword", ["target", "lazy"])
def test_pth_hook_registers_with_either_keyword(keyword):
    registry = _Registry(keyword)
    assert _lmeval_hook.register_model(registry)
    assert registry["alspec"] == "alspec_eval.adapter:ALSpecLM"


def test_pth_hook_gives_up_quietly_on_an_unknown_registry():
    assert not _lmeval_hook.register_model(_Registry(None))


def test_untested_lm_eval_is_named_in_one_line(monkeypatch):
    monkeypatch.setattr(compat, "version", lambda _: "0.5.0")
    with pytest.raises(ConfigError, match=r"lm-eval 0\.5\.0 is installed.*lm-eval==0\.4\.13"):
        compat.check_lm_eval()


def test_the_cache_goes_by_the_name_the_installed_forward_takes():
    """transformers 5.24 on takes ``cache=`` (``past_key_values=`` warns); the versions before it only
    ``past_key_values=``: each model class gets the keyword its own forward names."""
    class Before:
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None):
            return input_ids

    class From524:
        def forward(self, input_ids, attention_mask=None, cache=None, use_cache=None, **kwargs):
            return input_ids

    cache = object()
    assert compat.with_cache(Before(), cache) == {"past_key_values": cache}
    assert compat.with_cache(From524(), cache) == {"cache": cache}


def test_crop_cache_keeps_the_first_positions_and_nothing_dropped_is_a_no_op():
    """transformers' ``crop(0)`` drops nothing in 5.x and everything in 4.56 (its argument was the length to keep
    there): compat.crop_cache keeps the first ``length`` positions in both, the whole cache where it is not longer."""
    from transformers import DynamicCache

    cache = DynamicCache()
    keys = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(1, 2, 5, 3)
    for layer in range(2):
        cache.update(keys + layer, -keys, layer)
    compat.crop_cache(cache, 5)
    compat.crop_cache(cache, 7)
    assert cache.get_seq_length() == 5
    compat.crop_cache(cache, 3)
    assert cache.get_seq_length() == 3
    assert all(torch.equal(layer.keys, keys[:, :, :3] + i) for i, layer in enumerate(cache.layers))


def test_rope_settings_are_written_as_the_config_class_takes_them():
    """5.x configs take ``rope_parameters`` (theta inside); 4.x configs ``rope_theta`` and ``rope_scaling`` (and
    Gemma 3's ``rope_local_base_freq``), and would keep an unknown ``rope_parameters`` silently as an attribute."""
    class Before:
        def __init__(self, rope_theta=10000.0, rope_scaling=None, **kwargs):
            pass

    class BeforeGemma3(Before):
        def __init__(self, rope_theta=1e4, rope_scaling=None, rope_local_base_freq=1e4, **kwargs):
            pass

    class From5:
        def __init__(self, rope_parameters=None, **kwargs):
            pass

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    assert compat.rope_config(From5, llama3) == {"rope_parameters": llama3}
    assert compat.rope_config(Before, llama3) == {"rope_theta": 500000.0,
                                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert compat.rope_config(Before, {"rope_type": "default", "rope_theta": 1e6}) == {"rope_theta": 1e6}
    per_type = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    assert compat.rope_config(BeforeGemma3, per_type) == {"rope_theta": 1e6, "rope_local_base_freq": 1e4}
    with pytest.raises(ValueError, match="sliding-window layers"):
        compat.rope_config(Before, per_type)


def test_crop_cache_never_asks_a_cache_to_crop_zero_or_a_length():
    """crop(0) empties a 4.x cache and drops nothing in 5.x; crop_cache passes only a negative count, on any version."""
    from types import SimpleNamespace

    calls = []
    cache = SimpleNamespace(get_seq_length=lambda: 5, crop=calls.append)
    for length in (5, 7, 3):
        compat.crop_cache(cache, length)
    assert calls == [-2]


def test_a_configs_dtype_under_either_name():
    from types import SimpleNamespace

    from transformers import LlamaConfig

    assert compat.config_dtype(LlamaConfig(dtype="bfloat16")) == torch.bfloat16
    assert compat.config_dtype(SimpleNamespace(torch_dtype="float16")) == torch.float16  # the name before 4.56
    assert compat.config_dtype(SimpleNamespace(dtype=torch.bfloat16)) == torch.bfloat16
    assert compat.config_dtype(SimpleNamespace()) == torch.float32
