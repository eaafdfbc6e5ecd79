"""Ships `alspec_eval_lmeval.pth`, which registers `--model alspec` with lm-eval 0.4.13 (no plugin discovery there)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "alspec_eval_lmeval.pth"


class BuildPyWithPth(build_py):
    """Copy the registration .pth into the root of site-packages, for regular and editable installs."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]

    def get_output_mapping(self) -> dict[str, str]:
        return {**super().get_output_mapping(), str(Path(self.build_lib) / PTH): PTH}


setup(cmdclass={"build_py": BuildPyWithPth})
