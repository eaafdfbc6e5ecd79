"""backend=tt: decode-step attention on a Tenstorrent device through ``ttnn``; the rest of the model stays in torch.

Each decode step uploads the query and the layer's KV cache (in ``tt_kv_dtype``: bfloat8_b as in the paper,
or bfloat16) and runs the exact attention through ``ttnn.transformer.scaled_dot_product_attention_decode``
and the approximation through the same op over the two tile-aligned sink windows (window_align=32: the last
window ends at ceil32(pos+1), later positions masked). Where the installed ttnn has the authors'
``ttnn.experimental.speculative_scaled_dot_product_attention_decode``, one call gives the exact and the
speculative output and the squared distance and norm, and the device's numbers decide. Acceptance compares
squares, d^2 <= lambda^2 n^2, as the op does. Everything else (decisions, commits, statistics) is the sim
backend's ``Speculator``.

``tt_kernel=ttlang`` replaces the ttnn op with the TT-Lang speculative flash decode kernel
(``alspec_eval.kernels.ttlang``): one kernel gives A, A~ (the first partial of A), d^2 and n^2. It runs on a card
with the TT-Lang compiler (``tt_mode=device``) or on tt-lang-sim (``tt_mode=host``: the simulator brings its own
``ttnn``, so the real one is not needed, and computes in float32; it rebinds ``torch.bfloat16`` to float32 for the
whole process, so a model loaded as bfloat16 afterwards is float32).

``tt_mode=host`` runs the same code with each device op replaced by ttnn's own golden function, on host
tensors made by ``ttnn.from_torch``, so CI can run it without a card. Without a card ttnn builds no tile-layout
tensors (bfloat8_b included), so the host mode rounds the KV cache to bfloat8_b itself (``round_bfloat8_b``).

Teacher-forced rows of a loglikelihood pass (several query positions per call) take the host path of the sim
backend (model-dtype attention over the host KV cache, window_align=32), so their KV cache is not rounded to
``tt_kv_dtype``. The KV cache is uploaded again at every step: the device sees the same values a resident
cache would (block-float rounding is per token), at the cost of host-to-device traffic.
"""

from __future__ import annotations

import atexit
import functools
from types import ModuleType
from typing import Any, Callable

import torch
from transformers import PreTrainedModel

from .. import hooks, semantics
from ..config import ConfigError, SpeculationConfig
from ..kernels import SpecDecodeOutput
from ..speculator import Speculator

INSTALL_HINT = ("ttnn wheels exist for Python 3.10 and 3.12 only: run `bash scripts/tt_env.sh` (creates .venv-tt "
                "with Python 3.12) or `pip install ttnn` into a Python 3.12 environment")
TILE = semantics.TILE
SPECULATIVE_OP = "speculative_scaled_dot_product_attention_decode"


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
    from ..kernels.ttlang.decode import COMPILER, INSTALL_HINT as TTLANG_HINT, SIM, flavour

    kind = flavour()
    if kind is None:
        raise ConfigError(f"backend=tt with tt_kernel=ttlang needs TT-Lang (the `ttl` package), which is not "
                          f"installed; {TTLANG_HINT}; or use tt_kernel=ttnn")
    if config.tt_mode == "host" and kind == COMPILER:
        raise ConfigError("tt_kernel=ttlang with tt_mode=host runs the kernel on the simulator (tt-lang-sim), but the "
                          "installed TT-Lang is the compiler (tt-lang); use tt_mode=device on a Tenstorrent card, or "
                          "an environment with `pip install tt-lang-sim`")
    if config.tt_mode == "device" and kind == SIM:
        raise ConfigError("tt_kernel=ttlang with tt_mode=device needs the TT-Lang compiler (tt-lang) and a Tenstorrent "
                          "card, but only the simulator (tt-lang-sim) is installed; use tt_mode=host to run the kernel "
                          "on the simulator")
    return kind == SIM


def check_environment(config: SpeculationConfig) -> None:
    """Fail before the model loads when ttnn, TT-Lang (tt_kernel=ttlang) or, with tt_mode=device, the Tenstorrent
    device is missing."""
    if config.tt_kernel == "ttlang" and check_ttlang(config):
        return
    ttnn = import_ttnn()
    if config.tt_mode == "host":
        return
    try:
        available = ttnn.GetNumAvailableDevices()
    except RuntimeError:  # ttnn raises TT_FATAL "No chips detected in the cluster" rather than returning 0
        available = 0
    if config.tt_device_id >= available:
        found = "no Tenstorrent device was found" if available == 0 else f"only {available} Tenstorrent device(s) were found"
        raise ConfigError(f"backend=tt with tt_mode=device and tt_device_id={config.tt_device_id}: {found}; "
                          "run on a machine with a Tenstorrent card, or use tt_mode=host (ttnn's golden functions "
                          "on the host) or backend=sim")


def _ceil(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def left_align(cache: torch.Tensor, pad: torch.Tensor, length: int) -> torch.Tensor:
    """(B, H, L, D) left-padded rows moved to start at index 0 and zero-filled to ``length`` positions.

    The TT op counts positions from index 0 and has no per-row start, so each row's sequence is shifted.
    """
    out = cache.new_zeros((*cache.shape[:2], length, cache.shape[3]))
    for b, p in enumerate(pad.tolist()):
        out[b, :, :cache.shape[2] - p] = cache[b, :, p:]
    return out


def sink_windows(cache: torch.Tensor, pos: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first S and the tile-aligned last S positions of each left-aligned row, and the current token's index
    in them: keys after it are masked by the causal decode op, exactly the window_align=32 definition."""
    index, valid = semantics.window_positions(pos, window, TILE)  # (B, 2S), ascending
    gathered = torch.stack([cache[b][:, index[b]] for b in range(len(pos))])
    return gathered, valid.sum(1) - 1


def round_bfloat8_b(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as tt-metal packs bfloat8_b tiles: each 16 values of a face row (16 consecutive entries of
    the last dim, one token's) share the exponent of the largest and keep a 7-bit magnitude, rounded to nearest
    even and saturated. The result is exact in bfloat16. ``ttnn.from_torch`` does this only with a card present.
    """
    groups = x.float().reshape(*x.shape[:-1], -1, 16)
    _, exponent = torch.frexp(groups.abs().amax(-1, keepdim=True))  # max in [2^(e-1), 2^e)
    step = torch.ldexp(torch.ones_like(groups[..., :1]), exponent - 7)
    mantissa = torch.round(groups.abs() / step).clamp_max(127)
    return (groups.sign() * mantissa * step).reshape(x.shape).to(torch.bfloat16)


class TTRuntime:
    """The ttnn calls of one run: on the device, or their golden functions on host tensors (tt_mode=host)."""

    def __init__(self, ttnn: ModuleType, config: SpeculationConfig) -> None:
        self.ttnn = ttnn
        self.kv_dtype = getattr(ttnn, config.tt_kv_dtype)
        self.device = None
        self.ttlang: Callable | None = None  # tt_kernel=ttlang: kernels.ttlang.decode.ttlang_decode on this device
        if config.tt_mode == "device":
            self.device = ttnn.open_device(device_id=config.tt_device_id)
            atexit.register(ttnn.close_device, self.device)
        if config.tt_kernel == "ttlang":
            from ..kernels.ttlang.decode import ttlang_decode

            device = self.device if self.device is not None else ttnn.open_device(device_id=0)  # the simulator's
            self.ttlang = functools.partial(ttlang_decode, device=device)
            self.sdpa_decode = self.speculative = None
            return
        self.sdpa_decode = self._op(ttnn.transformer.scaled_dot_product_attention_decode)
        speculative = getattr(getattr(ttnn, "experimental", None), SPECULATIVE_OP, None)
        self.speculative = None if speculative is None else self._op(speculative)

    def _op(self, op: Callable) -> Callable:
        """The op itself on the device; on the host its golden function on the tensors' torch values."""
        if self.device is not None:
            return op
        golden = self.ttnn.get_golden_function(op)
        to_torch = self.ttnn.to_torch

        def host_op(*tensors: Any, **kwargs: Any) -> Any:
            return golden(*(to_torch(t) for t in tensors), **kwargs)

        return host_op

    def upload(self, tensor: torch.Tensor, dtype: Any) -> Any:
        """A ttnn tensor of ``dtype`` on the device; on the host (where ttnn builds no tiles without a card) a
        row-major bfloat16 one holding the values ``dtype`` would hold."""
        ttnn = self.ttnn
        if self.device is not None:
            return ttnn.from_torch(tensor.contiguous(), dtype=dtype, layout=ttnn.TILE_LAYOUT, device=self.device)
        if dtype == ttnn.bfloat8_b:
            tensor = round_bfloat8_b(tensor)
        return ttnn.from_torch(tensor.contiguous(), dtype=ttnn.bfloat16, layout=ttnn.ROW_MAJOR_LAYOUT)

    def download(self, tensor: Any) -> torch.Tensor:
        return tensor if isinstance(tensor, torch.Tensor) else self.ttnn.to_torch(tensor)

    def kernel_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int,
                      scale: float) -> tuple[torch.Tensor, ...]:
        """tt_kernel=ttlang: (A, A~, d^2, n^2) of a decode step from the TT-Lang kernel. On the simulator (which
        computes in float32 whatever the dtype) the KV cache is rounded to bfloat8_b here, as in the golden path."""
        kv_dtype = self.kv_dtype
        if self.device is None:
            if kv_dtype == self.ttnn.bfloat8_b:
                k, v = round_bfloat8_b(k), round_bfloat8_b(v)
            kv_dtype = self.ttnn.bfloat16
        return self.ttlang(q, k, v, pos.tolist(), window, scale, kv_dtype=kv_dtype)


class TTSpeculator(Speculator):
    """The speculator with the TT op as its decode kernel and the op's squared-norm verification."""

    def __init__(self, config: SpeculationConfig, num_layers: int, skipped_layers: dict[int, str],
                 base_attention: Callable, runtime: TTRuntime) -> None:
        super().__init__(config, num_layers, skipped_layers, base_attention, self.decode)
        self.runtime = runtime

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: torch.Tensor, window: int,
               lam: float | torch.Tensor, chunk_size: int | None = None, window_align: int = TILE,
               scale: float | None = None, *, start: torch.Tensor | None = None) -> SpecDecodeOutput:
        """A decode step on the device (a ``kernels.DecodeKernel``): q (B, Hq, D), k/v (B, Hkv, L, D)."""
        rt, ttnn = self.runtime, self.runtime.ttnn
        batch, heads, dim = q.shape
        pad = torch.zeros_like(cur_pos) if start is None else start
        pos = (cur_pos - pad).to(torch.long)
        length = _ceil(k.shape[2], TILE)
        k, v = left_align(k, pad, length), left_align(v, pad, length)
        trivial = semantics.is_trivial(pos, window)
        if rt.ttlang is not None:  # tt_kernel=ttlang: one kernel for A, A~ and the verification sums
            exact, approx, d2, n2 = rt.kernel_decode(q, k, v, pos, window, scale)
            return self._output(exact.to(q.dtype), approx.to(q.dtype), d2, n2, lam, trivial)
        qt = rt.upload(q[None], ttnn.bfloat16)  # the op's [1, B, Hq, D]

        def host(out: Any) -> torch.Tensor:  # [1, B, padded heads, D] -> (B, Hq, D)
            return rt.download(out)[0, :batch, :heads, :dim].to(q.dtype)

        if rt.speculative is not None:
            exact, approx, d2, n2 = rt.speculative(
                qt, rt.upload(k, rt.kv_dtype), rt.upload(v, rt.kv_dtype), lambda_=float(torch.as_tensor(lam).max()),
                speculative_chunk_size=window, cur_pos=pos.tolist(), scale=scale)
            d2, n2 = (rt.download(t).float().flatten()[:batch] for t in (d2, n2))
            return self._output(host(exact), host(approx), d2, n2, lam, trivial)
        exact = rt.sdpa_decode(qt, rt.upload(k, rt.kv_dtype), rt.upload(v, rt.kv_dtype), cur_pos=pos.tolist(), scale=scale)
        (k_w, w_pos), (v_w, _) = sink_windows(k, pos, window), sink_windows(v, pos, window)
        approx = rt.sdpa_decode(qt, rt.upload(k_w, rt.kv_dtype), rt.upload(v_w, rt.kv_dtype), cur_pos=w_pos.tolist(),
                                scale=scale)
        exact, approx = host(exact), host(approx)
        d, n = semantics.distances(approx, exact)
        return SpecDecodeOutput(exact, approx, d, n, semantics.accept_squared(d * d, n * n, lam) | trivial, trivial)

    @staticmethod
    def _output(exact: torch.Tensor, approx: torch.Tensor, d2: torch.Tensor, n2: torch.Tensor,
                lam: float | torch.Tensor, trivial: torch.Tensor) -> SpecDecodeOutput:
        """The step's output from the device's own squared distance and norm."""
        accept = semantics.accept_squared(d2, n2, lam) | trivial
        return SpecDecodeOutput(exact, approx, d2.sqrt(), n2.sqrt(), accept, trivial)

    def verify(self, approx: torch.Tensor, exact: torch.Tensor,
               lam: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Host-side rows (teacher forcing) decide in the op's squared form too."""
        d, n = semantics.distances(approx, exact)
        return semantics.accept_squared(d * d, n * n, lam), d / n


def install(model: PreTrainedModel, config: SpeculationConfig) -> TTSpeculator:
    """Hook the model like the sim backend, with decode steps on the TT device (or its golden functions)."""
    check_environment(config)
    if config.tt_kernel == "ttlang":
        from ..kernels.ttlang.decode import load_ttnn

        ttnn = load_ttnn()  # on tt-lang-sim: the simulator's ttnn
    else:
        ttnn = import_ttnn()
    runtime = TTRuntime(ttnn, config)

    return hooks.install(model, config, TTSpeculator, runtime=runtime)
