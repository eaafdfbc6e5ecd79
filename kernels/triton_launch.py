"""Launch settings of the Triton decode kernels per (dtype, head_dim), and whether they fit a GPU architecture.

A binary of the kernel depends only on its constexprs (the dtype, head_dim and the block sizes) and the launch
settings; the group, window, lengths, batch and left padding are runtime values. What may
run where is decided from a compiled binary, its shared memory and registers against the architecture's per-block
limits. Triton compiles for any CUDA architecture without a GPU (its wheel ships ptxas and cuobjdump): the tests
prove every combination on the CPU, and ``kernel=auto`` checks the one a model needs before anything launches.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Launch:
    """The kernel's keys per loop step, software-pipeline stages and warps."""

    block_n: int
    num_stages: int
    num_warps: int = 4


@dataclass(frozen=True)
class Arch:
    """Per-block limits of one CUDA architecture (the CUDA programming guide's compute capability table)."""

    capability: int
    shared_per_block: int  # bytes a block may opt in to
    registers_per_block: int = 65536
    registers_per_thread: int = 255


# The GPUs users evaluate on: A100 (sm_80); A10, A40, RTX 3090 (sm_86); L4, L40S, RTX 4090 (sm_89); H100 (sm_90).
ARCHS = {80: Arch(80, 166912), 86: Arch(86, 101376), 89: Arch(89, 101376), 90: Arch(90, 232448)}
DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def pow2(n: int) -> int:
    """The smallest power of two >= n (a tile's extent)."""
    return 1 << max(n - 1, 0).bit_length()


def blocks(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_D): tl.dot needs powers of two of at least 16."""
    return max(16, pow2(group)), max(16, pow2(head_dim))


def launch_for(dtype: torch.dtype, head_dim: int) -> Launch:
    """Settings that fit every architecture in ARCHS (the compile test proves it), so they need no key by
    architecture, and under which ptxas spills (Triton 3.9) at most 8 bytes per thread, in one case only (fp32,
    head_dim 128, sm_90): fp32 tiles take twice the bytes of 16-bit ones and its dot runs without tensor
    cores, so it streams 16 keys per step in 2 stages, and heads wider than 128 stream 16 keys per step (32 left the
    merge after the loop too few registers on sm_90)."""
    block_d = blocks(1, head_dim)[1]
    if dtype != torch.float32:
        return Launch(64, 3) if block_d <= 128 else Launch(16, 3)
    return Launch(16, 2)


def arch_of(device: torch.device) -> Arch:
    """The limits of the CUDA device ``device``: as it reports them (torch >= 2.6), else by its architecture."""
    props = torch.cuda.get_device_properties(device)
    capability = 10 * props.major + props.minor
    shared = getattr(props, "shared_memory_per_block_optin", None)
    return Arch(capability, shared) if shared else ARCHS.get(capability, Arch(capability, ARCHS[86].shared_per_block))


@dataclass(frozen=True)
class Resources:
    """What one compiled binary asks of a block."""

    kernel: str
    shared: int
    registers: int
    threads: int
    spilled: int = 0  # bytes of stack per thread where registers ran out (slower, not a misfit)

    def misfit(self, arch: Arch) -> str | None:
        """Why this binary cannot launch on ``arch``, else None."""
        if self.shared > arch.shared_per_block:
            return (f"the {self.kernel} kernel needs {self.shared} bytes of shared memory per block, sm_{arch.capability} "
                    f"allows {arch.shared_per_block}")
        if self.registers > arch.registers_per_thread or self.registers * self.threads > arch.registers_per_block:
            return (f"the {self.kernel} kernel needs {self.registers} registers for each of {self.threads} threads, "
                    f"sm_{arch.capability} allows {arch.registers_per_thread} per thread and "
                    f"{arch.registers_per_block} per block")
        return None


# The merge after the partials: (query head, dim) elements it holds at once (4 floats per thread of 4 warps), the
# partials it reads at once (their loads overlap), and the heads whose squared sums the verdict adds at once.
MERGE = {"BLOCK_E": 512, "CHUNK_S": 4, "BLOCK_H": 16}


def constexprs(dtype: torch.dtype, group: int, head_dim: int, launch: Launch) -> dict[str, object]:
    """The kernel's constexprs: what :func:`.triton_decode.speculative_flash_decode_triton` launches. A binary per
    dtype, head_dim, block sizes and launch settings: shapes that differ only in their group or lambda's kind share
    one."""
    block_g, block_d = blocks(group, head_dim)
    return {"HEAD_DIM": head_dim, "BLOCK_G": block_g, "BLOCK_D": block_d, "BLOCK_N": launch.block_n, "EVEN_D": head_dim == block_d,
            **MERGE, "IEEE": dtype == torch.float32}


# The paged verifier (.triton_verify): 16 keys a step in 2 stages. Every key's address is a 64-bit pointer per channel
# (the strides are the cache layout's); at 32 keys ptxas spills at head_dim 80 and 96 in 16-bit and past 64 in float32
# (sm_90, Triton 3.9); at 16 nothing spills on sm_90 (tests/kernels/test_triton_compile.py).
VERIFY_LAUNCH = Launch(16, 2)


def verify_constexprs(dtype: torch.dtype, group: int, head_dim: int, page: int) -> dict[str, object]:
    """The paged verifier's constexprs for a model's shape: one binary per dtype, head_dim and block size."""
    block_g, block_d = blocks(group, head_dim)
    return {"HEAD_DIM": head_dim, "BLOCK_G": block_g, "BLOCK_D": block_d, "BLOCK_N": VERIFY_LAUNCH.block_n,
            "EVEN_D": head_dim == block_d, "IEEE": dtype == torch.float32, "PAGE": page}


# Each kernel by name: the module of its source and its jitted function (the paged one reads a block table).
KERNELS = {"decode": (".triton_source", "decode_kernel"), "paged": (".triton_paged_source", "paged_decode_kernel"),
           "verify": (".triton_verify_source", "paged_verify_kernel")}
PAGE = 16  # the block size the paged kernel is compiled for by default (vLLM's FlashAttention default)


@functools.lru_cache(maxsize=None)
def kernel(name: str = "decode") -> Any:
    """The jitted kernel ``name`` of KERNELS, built on first use (Triton decides interpret mode when it is)."""
    module, function = KERNELS[name]
    try:
        source = importlib.import_module(module, __package__)
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "kernel=triton needs the `triton` package (pip install triton, or alspec-eval[triton]); "
            "use kernel=torch for the reference implementation"
        ) from err
    return getattr(source, function)


_MODEL = ("q_ptr", "k_ptr", "v_ptr", "exact_ptr")
_ROWS = ("token_ptr", "request_ptr", "starts_ptr", "ends_ptr", "pos_ptr")  # the paged verifier's rows, int64


def _signature(arg_names: list[str], dtype: torch.dtype, constants: dict) -> dict[str, str]:
    """Triton's argument types as the launcher passes them: the model's tensors in its dtype, the geometry, the
    tickets and the block table int32, decisions int1, the kernel's own buffers float32; sizes i32, the scale and
    lambda fp32."""
    model = "*" + DTYPES[dtype]
    types = {**dict.fromkeys(_MODEL, model), **dict.fromkeys(_ROWS, "*i64"), "geom_ptr": "*i32", "table_ptr": "*i32",
             "ticket_ptr": "*i32", "accept_ptr": "*i1", "scale": "fp32", "lam": "fp32"}
    return {name: "constexpr" if name in constants else types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
            for name in arg_names}


def _usage(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers, stack bytes) per thread of ``name`` in ``cubin``, as cuobjdump (shipped with Triton) reports."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(rf"Function {name}:\s*REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump reported no registers for {name}: {usage}")
    return int(found.group(1)), int(found.group(2))


def compile_kernels(dtype: torch.dtype, group: int, head_dim: int, capability: int, launch: Launch,
                    names: tuple[str, ...] = ("decode",), page: int = PAGE) -> tuple[Resources, ...]:
    """Compile the kernels ``names`` (the paged one for blocks of ``page`` slots) for ``sm_<capability>`` (no GPU
    needed) and return what each asks of a block."""
    decode = constexprs(dtype, group, head_dim, launch)
    constants = {"decode": decode, "paged": {**decode, "PAGE": page},
                 "verify": verify_constexprs(dtype, group, head_dim, page)}
    return tuple(_compile(name, dtype, tuple(constants[name].items()), capability,
                          VERIFY_LAUNCH if name == "verify" else launch) for name in names)  # the verifier's own settings


@functools.lru_cache(maxsize=None)
def _compile(name: str, dtype: torch.dtype, constants: tuple, capability: int, launch: Launch) -> Resources:
    """One binary, compiled once per process (shapes that differ only in runtime values share it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel(name)
    if not hasattr(fn, "arg_names"):
        raise RuntimeError("Triton's interpreter is on (TRITON_INTERPRET=1): it compiles nothing for a GPU; run "
                           "python -m alspec_eval.kernels.triton_launch without it")
    source = ASTSource(fn, _signature(fn.arg_names, dtype, dict(constants)), dict(constants))
    binary = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                            options={"num_stages": launch.num_stages, "num_warps": launch.num_warps})
    registers, stack = _usage(binary.asm["cubin"], fn.__name__)
    return Resources(name, binary.metadata.shared, registers, 32 * launch.num_warps, stack)


def misfit(dtype: torch.dtype, group: int, head_dim: int, arch: Arch, launch: Launch | None = None,
           names: tuple[str, ...] = ("decode",), page: int = PAGE) -> str | None:
    """Why the kernels ``names`` cannot run this shape on ``arch`` (with :func:`launch_for`'s settings by default),
    else None."""
    if dtype not in DTYPES:
        return f"the Triton kernels take {', '.join(map(str, DTYPES))}, not {dtype}"
    for resources in compile_kernels(dtype, group, head_dim, arch.capability,
                                     launch or launch_for(dtype, head_dim), names, page):
        reason = resources.misfit(arch)
        if reason:
            return reason
    return None


MATRIX = {"dtype": tuple(DTYPES), "head_dim": (64, 80, 96, 128, 256), "group": (1, 4, 8, 16)}


def main(argv: list[str] | None = None) -> int:
    """Print, one JSON line per shape, what each kernel asks of a block on each architecture and whether it fits
    (every dtype, head_dim and group ``kernel=auto`` can pick; scalar and per-row lambda share a binary). Exits 1 if
    one does not."""
    parser = argparse.ArgumentParser(prog="python -m alspec_eval.kernels.triton_launch", description=main.__doc__)
    parser.add_argument("--arch", type=int, action="append", choices=sorted(ARCHS),
                        help="compute capability (repeatable; default: all of 80, 86, 89, 90)")
    parser.add_argument("--launch", metavar="BLOCK_N,STAGES", type=lambda text: Launch(*map(int, text.split(","))),
                        help="these settings instead of launch_for's (to see what another choice would ask)")
    parser.add_argument("--kernel", action="append", choices=sorted(KERNELS),
                        help="which kernel (repeatable; default: decode, the one kernel=auto launches)")
    parser.add_argument("--page", type=int, default=PAGE, help=f"the paged kernel's block size (default {PAGE})")
    args = parser.parse_args(argv)
    names = tuple(args.kernel or ("decode",))
    import triton

    worst = 0
    for capability, dtype, head_dim, group in itertools.product(args.arch or sorted(ARCHS), *MATRIX.values()):
        launch = args.launch or launch_for(dtype, head_dim)
        found = compile_kernels(dtype, group, head_dim, capability, launch, names, args.page)
        reason = misfit(dtype, group, head_dim, ARCHS[capability], launch, names, args.page)
        worst = max(worst, reason is not None)
        print(json.dumps({"triton": triton.__version__, "arch": capability, "dtype": DTYPES[dtype], "head_dim": head_dim, "group": group,
                          "launch": vars(launch),
                          "kernels": {r.kernel: {"shared": r.shared, "registers": r.registers, "spilled": r.spilled}
                                      for r in found},
                          "misfit": reason}), flush=True)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
