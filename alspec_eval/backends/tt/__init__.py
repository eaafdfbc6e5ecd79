"""backend=tt: decode-step attention on a Tenstorrent device through ``ttnn``; the rest of the model stays in torch.

- ``contract``: the authors' speculative op as code (keywords, preconditions, configs, host golden);
- ``runtime``: the ttnn calls, on the card or as golden functions on the host (``tt_mode=host``, no card);
- ``speculator``: the decode step (resident KV cache, trivial rows on ttnn's exact decode op, the op's squared
  norms decide).

``tt_kernel=ttlang`` replaces the ttnn ops with the TT-Lang speculative flash decode kernel
(``alspec_eval.kernels.ttlang``) on a card with the TT-Lang compiler (``tt_mode=device``) or on tt-lang-sim
(``tt_mode=host``: the simulator brings its own ``ttnn`` and computes in float32; it rebinds ``torch.bfloat16``
to float32 for the whole process).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from transformers import PreTrainedModel

from ... import hooks
from .. import Backend
from ...config import ConfigError, SpeculationConfig
from . import contract
from .runtime import TTRuntime, round_bfloat8_b
from .speculator import TTSpeculator

__all__ = ["TTBackend", "TTRuntime", "TTSpeculator", "check_environment", "check_model", "install", "prepare",
           "round_bfloat8_b"]

INSTALL_HINT = ("ttnn wheels exist for Python 3.10 and 3.12 only: run `bash scripts/tt_env.sh` (creates .venv-tt "
                "with Python 3.12) or `pip install ttnn` into a Python 3.12 environment")

def import_ttnn() -> ModuleType:
    """ttnn, or a ConfigError that says how to install it."""
    try:
        import ttnn
    except ImportError as exc:
        raise ConfigError(f"backend=tt needs the ttnn package, which cannot be imported ({exc}); {INSTALL_HINT}") from None
    return ttnn


def check_ttlang(config: SpeculationConfig) -> bool:
    """tt_kernel=ttlang: fail unless the installed TT-Lang fits tt_mode. True where it runs on the simulator
    (which needs neither the real ttnn nor a card)."""
    from ...kernels.ttlang.decode import COMPILER, INSTALL_HINT as TTLANG_HINT, SIM, flavour

    kind = flavour()
    if kind is None:
        raise ConfigError(f"backend=tt with tt_kernel=ttlang needs TT-Lang (the `ttl` package), which is not "
                          f"installed; {TTLANG_HINT}; or use tt_kernel=ttnn")
    if config.tt.mode == "host" and kind == COMPILER:
        raise ConfigError("tt_kernel=ttlang with tt_mode=host runs the kernel on the simulator (tt-lang-sim), but the "
                          "installed TT-Lang is the compiler (tt-lang); use tt_mode=device on a Tenstorrent card, or "
                          "an environment with `pip install tt-lang-sim`")
    if config.tt.mode == "device" and kind == SIM:
        raise ConfigError("tt_kernel=ttlang with tt_mode=device needs the TT-Lang compiler (tt-lang) and a Tenstorrent "
                          "card, but only the simulator (tt-lang-sim) is installed; use tt_mode=host to run the kernel "
                          "on the simulator")
    return kind == SIM


def check_environment(config: SpeculationConfig) -> None:
    """Fail before the model loads when ttnn, TT-Lang (tt_kernel=ttlang) or, with tt_mode=device, the Tenstorrent
    device is missing."""
    if config.tt.kernel == "ttlang" and check_ttlang(config):
        return
    ttnn = import_ttnn()
    if config.tt.mode == "host":
        return
    try:
        available = ttnn.GetNumAvailableDevices()
    except RuntimeError:  # ttnn raises TT_FATAL "No chips detected in the cluster" rather than returning 0
        available = 0
    if config.tt.device_id >= available:
        found = "no Tenstorrent device was found" if available == 0 else f"only {available} Tenstorrent device(s) were found"
        raise ConfigError(f"backend=tt with tt_mode=device and tt_device_id={config.tt.device_id}: {found}; "
                          "run on a machine with a Tenstorrent card, or use tt_mode=host (ttnn's golden functions "
                          "on the host) or backend=sim")


def prepare(config: SpeculationConfig) -> TTRuntime:
    """Everything before the weights load: the environment, then the device (opened, so its grid is known)."""
    check_environment(config)
    if config.tt.kernel == "ttlang":
        from ...kernels.ttlang.decode import load_ttnn

        ttnn = load_ttnn()  # on tt-lang-sim: the simulator's ttnn
    else:
        ttnn = import_ttnn()
    return TTRuntime(ttnn, mode=config.tt.mode, device_id=config.tt.device_id, kv_dtype=config.tt.kv_dtype,
                     kernel=config.tt.kernel)


def check_model(runtime: TTRuntime, model_config: Any, batch_size: int | None) -> None:
    """The op's limits on the model's heads and the batch, from the model config (still before the weights load)."""
    if runtime.ttlang is not None:
        return
    text = model_config.get_text_config()
    heads = text.num_attention_heads
    contract.check_limits(heads, getattr(text, "num_key_value_heads", None) or heads, batch_size, runtime.cores)


def install(model: PreTrainedModel, config: SpeculationConfig, runtime: TTRuntime | None = None) -> TTSpeculator:
    """Hook the model like the sim backend, with decode steps on the TT device (or its golden functions)."""
    runtime = prepare(config) if runtime is None else runtime
    check_model(runtime, model.config, None)
    hooks.check_fused_kernel("the TT op (backend=tt)", model.config, model)
    return hooks.install(model, TTSpeculator, runtime=runtime)


class TTBackend(Backend):
    """backend=tt: ttnn (and the device, with tt_mode=device) checked and opened before the model loads."""

    def __init__(self, config: SpeculationConfig) -> None:
        super().__init__(config)
        self.runtime = prepare(config)  # no ttnn or no device: stop before the weights load

    def check_model(self, model_config: Any, batch_size: int | None, device: Any = None, dtype: Any = None) -> None:
        hooks.check_fused_kernel("the TT op (backend=tt)", model_config)
        check_model(self.runtime, model_config, batch_size)

    def install(self, model: PreTrainedModel) -> TTSpeculator:
        self.kernel_line = f"tt: tt_kernel={self.config.tt.kernel}, tt_mode={self.config.tt.mode}"
        return install(model, self.config, self.runtime)
