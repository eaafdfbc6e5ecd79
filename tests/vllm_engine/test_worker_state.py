"""A worker's decisions as the driver takes them (WorkerState.take): every (request, position, layer) at its own
place, code 0 and NaN where a layer does not speculate. Fast: torch only, no vLLM."""

from __future__ import annotations

import math

import pytest
import torch

from alspec_eval.approximations import default_approximation
from alspec_eval.vllm.backend import WorkerState
from alspec_eval.vllm.paged import Settings


def test_take_puts_each_code_at_its_layer_and_position():
    state = WorkerState(settings=Settings(thresholds=(0.1, 0.2, 0.3), window=4, window_align=1, approx=default_approximation()))
    truth = {}
    for step in range(2):  # two steps, tags 7 and 9 interleaved, layers in order
        tag = torch.tensor([7, 7, 9])
        pos = torch.tensor([10 + 2 * step, 11 + 2 * step, 20 + step])
        for layer in (0, 2):  # layer 1 off: code 0, NaN
            codes = torch.tensor([3, 2, 3]) if layer == 0 else torch.tensor([2, 3, 1])
            ratios = torch.tensor([0.01, 0.5, 0.02]) * (layer + 1) + step
            if layer == 2:
                ratios[2] = math.nan
            state.records.append((tag, pos, layer, codes, ratios, {}))
            for t, p, c, r in zip(tag.tolist(), pos.tolist(), codes.tolist(), ratios.tolist()):
                truth[t, p, layer] = (c, r)
    taken = state.take()
    got, again = taken.by_request(), taken.redecided
    assert sorted(got) == [7, 9] and state.records == [] and again == 0
    assert taken.codes.dtype == torch.int8 and taken.tags.tolist() == sorted(taken.tags.tolist())
    assert taken.names == ()  # a fixed budget that promises nothing: no measures
    for t, (positions, codes, ratios, measures) in got.items():
        assert measures == {}
        positions, codes, ratios = positions.tolist(), codes.tolist(), ratios.tolist()
        assert positions == sorted({p for (tt, p, _) in truth if tt == t})
        for i, p in enumerate(positions):
            for layer in range(3):
                c, r = truth.get((t, p, layer), (0, math.nan))
                assert codes[i][layer] == c, (t, p, layer)
                assert (math.isnan(r) and math.isnan(ratios[i][layer])) or math.isclose(ratios[i][layer], r, rel_tol=1e-6)


def test_a_position_decided_again_keeps_its_first_decision():
    """vLLM recomputes a preempted request's positions (a prefill of everything so far) after their outputs were
    read: the first pass's decisions stand, in whatever order the passes' layers were recorded, and each position
    decided again is counted once."""
    state = WorkerState(settings=Settings(thresholds=(0.1, 0.2), window=4, window_align=1, approx=default_approximation()))
    tag, pos = torch.tensor([5, 5, 6]), torch.tensor([30, 31, 40])
    for layer in (0, 1):  # first pass: request 5 at 30 and 31, request 6 at 40
        state.records.append((tag, pos, layer, torch.tensor([3, 2, 3]), torch.tensor([0.05, 0.5, 0.01]) + layer,
                              {}))
    recompute_tag, recompute_pos = torch.tensor([5, 5, 5]), torch.tensor([30, 31, 32])  # 32 is new
    for layer in (1, 0):
        state.records.append((recompute_tag, recompute_pos, layer, torch.tensor([2, 3, 3]),
                              torch.tensor([0.9, 0.02, 0.03]) + 10 * layer, {}))
    taken = state.take()
    got, again = taken.by_request(), taken.redecided
    assert again == 2  # (5, 30) and (5, 31), not per layer
    positions, codes, ratios, _ = got[5]
    assert positions.tolist() == [30, 31, 32]
    assert codes.tolist() == [[3, 3], [2, 2], [3, 3]]
    assert [[round(r, 4) for r in row] for row in ratios.tolist()] == [[0.05, 1.05], [0.5, 1.5], [0.03, 10.03]]
    assert got[6][1].tolist() == [[3, 3]]


def test_take_carries_each_decisions_measures():
    """A draft's measures (the keys each A~ read where the budget varies, the denominator's missed share where it
    promises it) come back beside the codes, in the same one read-back, at their own (request, position, layer), NaN
    where a layer measured none (an exact layer); a recompute keeps the first pass's, as it keeps its decisions."""
    from test_paged import ReadBacks

    state = WorkerState(settings=Settings(thresholds=(0.1, 0.2, 0.3), window=4, window_align=1, approx=default_approximation()))
    tag, pos = torch.tensor([5, 5, 6]), torch.tensor([30, 31, 40])
    state.records.append((tag, pos, 0, torch.tensor([3, 2, 3]), torch.tensor([0.1, 0.2, 0.3]),
                          {"keys": torch.tensor([17.0, 18.5, 40.0]), "denominator": torch.tensor([0.0, 0.5, 1.0])}))
    state.records.append((tag, pos, 2, torch.tensor([2, 2, 2]), torch.full((3,), math.nan), {}))
    state.records.append((torch.tensor([5]), torch.tensor([30]), 0, torch.tensor([2]), torch.tensor([0.9]),
                          {"keys": torch.tensor([99.0]), "denominator": torch.tensor([0.25])}))  # decided again
    with ReadBacks() as reads:
        taken = state.take()
    assert reads.calls.count("cpu") == 1 and taken.names == ("denominator", "keys")
    got = taken.by_request()
    keys = {t: got[t][3]["keys"] for t in (5, 6)}
    assert keys[5][:, 0].tolist() == [17.0, 18.5] and keys[6][:, 0].tolist() == [40.0]  # the first pass's stands
    assert got[5][3]["denominator"][:, 0].tolist() == [0.0, 0.5] and got[6][3]["denominator"][0, 0] == 1.0
    assert all(math.isnan(k) for t in (5, 6) for m in got[t][3].values() for k in m[:, 1:].flatten().tolist())


def test_take_reads_the_breaches_in_its_one_read_back():
    """What the draft's selections counted outside [0, pos] since the last take (``Settings.breaches``) comes back in
    the decisions' one read-back, and counting starts anew; with no decisions, alone."""
    from test_paged import ReadBacks

    settings = Settings(thresholds=(0.1,), window=4, window_align=1, approx=default_approximation())
    state = WorkerState(settings=settings)
    state.records.append((torch.tensor([5, 6]), torch.tensor([30, 40]), 0, torch.tensor([3, 2]),
                          torch.tensor([0.1, 0.2]), {}))
    settings.breaches.add(torch.tensor([False, True, True]), torch.tensor([10, 41, 30]))
    settings.breaches.add(torch.tensor([True]), torch.tensor([12]))
    with ReadBacks() as reads:
        taken = state.take()
    assert reads.calls.count("cpu") == 1 and (taken.out_of_bounds, taken.out_of_bounds_at) == (3, 41)
    assert taken.codes.tolist() == [[3], [2]]
    again = state.take()
    assert (again.out_of_bounds, again.out_of_bounds_at) == (0, -1)
    settings.breaches.add(torch.tensor([True]), torch.tensor([7]))
    last = state.take()
    assert (last.out_of_bounds, last.out_of_bounds_at) == (1, 7)


SETTINGS = {"approx": "sink", "approx_args": {}, "thresholds": [0.1], "window": 8, "window_align": 1,
            "check_layout": False}


def _worker(device: str, *impls: object) -> object:
    """An ALSpecWorker as vLLM mixes it in: its device, and attention layers with these impls."""
    from types import SimpleNamespace

    from alspec_eval.vllm.worker import ALSpecWorker

    layers = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(impl=impl, attn_backend=type(impl).backend)
              for i, impl in enumerate(impls)}
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return type("Worker", (ALSpecWorker,), {"device": torch.device(device), "model_runner": None,
                                            "vllm_config": config})()


def _impl(name: str, speculating: bool) -> object:
    from alspec_eval.vllm.backend import SpeculatingImpl

    backend = type(name, (), {"get_name": staticmethod(lambda: name)})
    return type(f"{name}Impl", (SpeculatingImpl,) if speculating else (), {"backend": backend})()


def test_configuring_a_cpu_worker_builds_the_kernel_before_any_step(monkeypatch):
    """The C kernel is built (or found in the cache) by the driver's configure call, at engine start, so that no
    engine step pays the compiler; a CUDA worker builds nothing."""
    from alspec_eval.vllm import native

    calls = []
    monkeypatch.setattr(native, "library", lambda: calls.append(1))
    for device, built in (("cuda", []), ("cpu", [1])):
        assert _worker(device, _impl("CPU_ATTN", True)).alspec_configure(SETTINGS) == []
        assert calls == built, device


def test_the_worker_owns_its_state_and_hands_it_to_its_speculating_layers():
    """What lasts the engine lives on the worker extension's instance, not in a module: configure hands it to every
    speculating impl (a plain one gets none), keeps it across configures with the records and the verifier reset,
    and two workers in one process keep apart."""
    speculating, plain = _impl("FLASH_ATTN", True), _impl("FLASHINFER", False)
    worker, other = _worker("cuda", speculating, plain), _worker("cuda", _impl("FLASH_ATTN", True))
    with pytest.raises(RuntimeError, match="before alspec_configure"):
        worker.alspec_take()
    worker.alspec_configure(SETTINGS)
    other.alspec_configure({**SETTINGS, "window": 16})
    state = worker.alspec_state
    assert speculating.alspec_state is state and not hasattr(plain, "alspec_state")
    assert state is not other.alspec_state and state.settings.window == 8
    state.verifier = object()  # the last draft's: chosen again for the new one
    state.records.append((torch.tensor([5]), torch.tensor([30]), 0, torch.tensor([3]), torch.tensor([0.1]), {}))
    worker.alspec_configure({**SETTINGS, "approx": "local"})
    assert worker.alspec_state is state and state.verifier is None and not state.records
    assert speculating.alspec_state is state and state.settings.approx.name == "local"


@pytest.mark.slow  # the driver's module imports vLLM where it is installed (which starts a process)
def test_a_layer_whose_backend_does_not_speculate_is_named_and_refused_by_the_driver(monkeypatch):
    """A worker names the backends of attention layers whose impl is not the speculating one (a backend
    alspec-vllm does not wrap, or its registration replaced); the driver refuses them in one line."""
    pytest.importorskip("vllm")
    from alspec_eval.config import SpeculationConfig
    from alspec_eval.vllm.model import ALSpecVLLM
    from alspec_eval.vllm.paged import LayoutError

    worker = _worker("cuda", _impl("FLASH_ATTN", True), _impl("FLASHINFER", False), _impl("TRITON_ATTN", False))
    plain = worker.alspec_configure(SETTINGS)
    assert plain == ["FLASHINFER", "TRITON_ATTN"]
    lm = object.__new__(ALSpecVLLM)
    lm.spec_config, lm.num_layers, lm.dump = SpeculationConfig(window=8), 3, False
    for answer, says in ((plain, "cannot read the KV cache of vLLM's FLASHINFER"),
                         (["TRITON_ATTN"], "TRITON_ATTN in this engine is not alspec-vllm's")):
        lm.model = type("LLM", (), {"collective_rpc": lambda self, *a, answer=answer, **k: [answer]})()
        with pytest.raises(LayoutError, match=says):
            lm._configure()
    lm.model = type("LLM", (), {"collective_rpc": lambda self, *a, **k: [[], []]})()
    lm._configure()  # every layer speculates on every rank
