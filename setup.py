"""Ships `alspec_eval_lmeval.pth`, which registers `--model alspec` with lm-eval 0.4.13 (no plugin discovery there)."""

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


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
