"""A forward pass's geometry on each device of a device map: a layer on another device than the pass's first gets
the pass's tensors on its own device, copied once per pass, and its decisions land in the pass's record. (Only one
kind of device is here: the second is PyTorch's meta device, which has shapes and no values.)"""

from __future__ import annotations

import torch

from alspec_eval.passes import Pass


def _pass() -> Pass:
    return Pass(q_len=1, offset=7, trivial=torch.zeros(2, 1, dtype=torch.bool), rows=torch.tensor([0, 1]),
                 cols=torch.tensor([0, 0]), pos=torch.tensor([7, 5]), pad=torch.tensor([0, 2]),
                 speculated=torch.ones(2, dtype=torch.bool), keys=(torch.arange(8).repeat(2, 1), None))


def test_a_pass_on_its_own_device_is_itself():
    step = _pass()
    assert step.on(torch.device("cpu")) is step


def test_a_pass_on_another_device_is_copied_there_once_and_shares_its_decisions():
    step = _pass()
    meta = torch.device("meta")
    moved = step.on(meta)
    assert moved is step.on(meta)  # once per pass
    for name in Pass.TENSORS:
        value = getattr(moved, name)
        assert value is None if getattr(step, name) is None else (value.device == meta and value.shape ==
                                                                   getattr(step, name).shape), name
    assert moved.keys[0].device == meta and moved.keys[1] is None  # the approximation's per-pass tensors too
    assert step.rows.device.type == "cpu" and moved.kernel_inputs is None
    moved.decisions[3] = None
    assert step.decisions == {3: None}


def test_an_idle_pass_has_nothing_to_copy():
    idle = Pass(q_len=4, offset=0, trivial=None)
    assert idle.on(torch.device("meta")) is idle
