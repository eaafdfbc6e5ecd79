"""The worker extension (``worker_extension_cls``): how the driver reaches every vLLM worker, tensor-parallel ranks
included, through ``LLM.collective_rpc``: the settings before requests are sent, the decisions after."""

from __future__ import annotations

from typing import Any

import torch

from ..approximations import make_approximation
from . import native
from .backend import SpeculatingImpl, Taken, WorkerState
from .paged import Settings


class ALSpecWorker:
    """Mixed into vLLM's worker class; its methods are called by name from the driver. What lasts the whole engine
    (the settings, the decisions recorded, the verifier) is this worker's :class:`.backend.WorkerState`, which
    :meth:`alspec_configure` hands to every speculating attention layer."""

    alspec_state: WorkerState | None = None

    def alspec_configure(self, settings: dict[str, Any]) -> list[str]:
        """Speculate with ``settings`` from the next step on (the fields of :class:`.paged.Settings`, the approximation
        as its name and arguments); drops decisions not yet taken. Returns the backends of the model's attention
        layers that do not speculate (:mod:`.backends` wraps none of them), which the driver refuses."""
        approx = make_approximation(settings["approx"], settings["approx_args"])
        state = self.alspec_state = self.alspec_state or WorkerState()
        state.runner = self.model_runner  # type: ignore[attr-defined]
        state.settings = Settings(tuple(float(t) for t in settings["thresholds"]), int(settings["window"]),
                                  int(settings["window_align"]), approx, bool(settings["check_layout"]),
                                  bool(settings.get("dump", False)), self._first_kv_head())
        state.records.clear()
        state.dumps.clear()
        state.verifier = None  # chosen again for this draft at the next speculating layer
        state.kept.clear()  # a draft's page summaries: made again from the cache from the next step on
        state.summarized.clear()
        if self.device.type == "cpu":  # type: ignore[attr-defined]
            native.library()  # built (or found in the cache) here, so that no engine step pays the compiler
        layers = self.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
        attention = [layer for layer in layers.values() if hasattr(layer, "impl")]
        for layer in attention:
            if isinstance(layer.impl, SpeculatingImpl):
                layer.impl.alspec_state = state
        return sorted({layer.attn_backend.get_name() for layer in attention
                       if not isinstance(layer.impl, SpeculatingImpl)})

    def alspec_take(self) -> list[Any]:
        """The decisions since the last take, packed, and how many positions were decided again
        (:meth:`.backend.WorkerState.take`), as the RPC carries them (:func:`taken` makes them again)."""
        return [packed(t) if isinstance(t, torch.Tensor) else t for t in self._alspec().take()]

    def alspec_dumps(self) -> list[dict[str, Any]]:
        """With ``dump`` set: every verified layer call's rows since the last call (for an outside reference)."""
        state = self._alspec()
        dumps, state.dumps = state.dumps, []
        return [{k: packed(v) if isinstance(v, torch.Tensor) else v for k, v in d.items()} for d in dumps]

    def alspec_observed(self) -> tuple[int, ...]:
        """The prompts whose observation this worker holds (:meth:`.backend.WorkerState.observations_held`)."""
        return self._alspec().observations_held()

    def alspec_backend(self) -> str | None:
        return self._alspec().backend

    def _first_kv_head(self) -> int:
        """The model's index of the first KV head this rank holds: rank r of t holds heads from r H / t, where H
        heads are split over t ranks, or the one head r H / t where each is replicated over t / H ranks."""
        config = self.vllm_config  # type: ignore[attr-defined]
        ranks = config.parallel_config.tensor_parallel_size
        if ranks == 1:
            return 0
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() * config.model_config.get_total_num_kv_heads() // ranks

    def _alspec(self) -> WorkerState:
        if self.alspec_state is None:
            raise RuntimeError("alspec-vllm's worker was asked for decisions before alspec_configure")
        return self.alspec_state


def packed(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as the RPC carries it fast: its bytes, dtype and shape (:func:`unpacked` makes it again)."""
    tensor = tensor.detach().cpu().contiguous()
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""}


def unpacked(value: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, value["dtype"])
    if not value["data"]:
        return torch.zeros(value["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(value["data"]), dtype=torch.uint8).view(dtype).view(value["shape"])


def taken(carried: list[Any]) -> Taken:
    """A worker's :meth:`~ALSpecWorker.alspec_take` as the driver reads it."""
    return Taken(*(unpacked(t) if isinstance(t, dict) else t for t in carried))
