"""Builds and installs the torch_mp Python package.

The build itself is CMake's (CMakeLists.txt holds the one list of C++ sources); this file only
drives it to produce torch_mp._C. Torch must already be installed, so install with::

    pip install --no-build-isolation .

With ``TORCH_MP_BUILD_DIR`` set to a CMake build directory that ``make build`` configured,
the extension is built there (nothing to do when it is current) and taken from the tree
(``torch_mp/_C*.so``) instead of configuring a build of its own: what ``make`` does for the
editable install into the project's environment and for the wheel it tests.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures CMake for the Python extension alone and builds target ``_C``."""

    def build_extension(self, ext: Extension) -> None:
        import torch.utils

        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        prebuilt = os.environ.get("TORCH_MP_BUILD_DIR")
        if prebuilt:
            subprocess.check_call(["cmake", "--build", prebuilt, "--target", "_C"])
            built = ROOT / "torch_mp" / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
            if not built.exists():
                raise RuntimeError(f"{built} is not built for this Python (run make build)")
            output_dir.mkdir(parents=True, exist_ok=True)
            if built.parent.resolve() != output_dir:
                shutil.copy2(built, output_dir / built.name)
            return
        build_dir = Path(self.build_temp).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DTORCH_MP_PYTHON_OUTPUT_DIR={output_dir}",
            "-DTORCH_MP_BUILD_TESTS=OFF",
            "-DTORCH_MP_BUILD_EXAMPLES=OFF",
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        subprocess.check_call(configure)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs])


setup(
    name="torch_mp",
    version="0.1.0",
    description="Model-parallel training for PyTorch (tensor, pipeline, data) over a C++ core",
    packages=find_packages(include=["torch_mp", "torch_mp.*"]),
    package_data={"torch_mp.models": ["data/*.txt"], "torch_mp.plan": ["machines/*.json"]},
    ext_modules=[CMakeExtension("torch_mp._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.11,<2.15"],
)
