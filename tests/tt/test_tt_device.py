"""On a Tenstorrent card: the device path agrees with the host mode that CI runs. Skips without a card."""

from __future__ import annotations

import pytest
import torch

ttnn = pytest.importorskip("ttnn", reason="ttnn is not importable here; it needs Python 3.10/3.12: scripts/tt_env.sh")


def _devices() -> int:
    try:
        return ttnn.GetNumAvailableDevices()
    except RuntimeError:  # "No chips detected in the cluster"
        return 0


pytestmark = [pytest.mark.skipif(_devices() == 0, reason="needs a Tenstorrent device"),
              pytest.mark.filterwarnings("ignore")]

from alspec_eval.backends.tt import TTRuntime, TTSpeculator, round_bfloat8_b
from alspec_eval.config import SpeculationConfig, TTSettings


def test_host_bfloat8_b_rounding_is_the_devices():
    x = torch.randn(2, 2, 96, 64) * 3
    device = ttnn.open_device(device_id=0)
    try:
        back = ttnn.to_torch(ttnn.from_torch(x, dtype=ttnn.bfloat8_b, layout=ttnn.TILE_LAYOUT, device=device))
    finally:
        ttnn.close_device(device)
    assert torch.equal(back.bfloat16(), round_bfloat8_b(x))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "bfloat8_b"])
def test_device_decode_matches_host_mode(kv_dtype):
    torch.manual_seed(0)
    q = (torch.randn(2, 4, 1, 64) * 2).bfloat16()
    k, v = (torch.randn(2, 2, 150, 64) * 2).bfloat16(), torch.randn(2, 2, 150, 64).bfloat16()
    pad = torch.tensor([0, 7])
    outs = {}
    for mode in ("host", "device"):
        config = SpeculationConfig(backend="tt", tt=TTSettings(mode=mode, kv_dtype=kv_dtype), window=32)
        speculator = TTSpeculator(1, {}, None, runtime=TTRuntime(ttnn, mode=mode, kv_dtype=kv_dtype))
        out = speculator.decode(0, q[:, :, 0], k, v, pad, 149 - pad, config.lam, 0.125, config)
        outs[mode] = (out.exact, out.spec)
    for device_out, host_out in zip(outs["device"], outs["host"], strict=True):
        torch.testing.assert_close(device_out.float(), host_out.float(), atol=3e-2, rtol=3e-2)
