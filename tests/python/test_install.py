"""torch_mp as users install it: imported from any directory after `make`, a wheel installed
into a clean environment, and a LibTorch application built against an installed prefix, each
run for real (torchrun, two Gloo ranks), without PYTHONPATH or LD_LIBRARY_PATH."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch.utils

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / os.environ.get("TORCH_MP_BUILD", "build")
BIN = Path(sys.executable).parent

SMOKE = """
import torch, torch.distributed as dist
from torch import nn
import torch_mp
from torch_mp import checkpoint

torch_mp.init(tp=2)
torch.manual_seed(0)
dense = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
mlp = nn.Sequential(
    torch_mp.ColumnParallelLinear.from_dense(dense[0]),
    nn.GELU(),
    torch_mp.RowParallelLinear.from_dense(dense[2]),
)
x = torch.randn(5, 8)
assert torch.allclose(mlp(x), dense(x), rtol=1e-5, atol=1e-6)
checkpoint.save(PATH, mlp)
with torch.no_grad():
    mlp[0].weight.zero_()
checkpoint.load(PATH, mlp)
assert torch.allclose(mlp(x), dense(x), rtol=1e-5, atol=1e-6)
if dist.get_rank() == 0:
    print("smoke OK from", torch_mp.__file__)
dist.destroy_process_group()
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    return dict(env, OMP_NUM_THREADS="1", **extra)


def _run(args: list[str], cwd: Path, timeout: int = 300, **env: str) -> str:
    result = subprocess.run(
        args, cwd=cwd, env=_clean_env(**env), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, " ".join(args) + "\n" + result.stdout + result.stderr
    return result.stdout


def test_the_package_imports_from_any_directory(tmp_path):
    out = _run([sys.executable, "-c", "import torch_mp; print(torch_mp.__file__)"], tmp_path)
    assert out.strip() == str(ROOT / "torch_mp" / "__init__.py")


def test_a_wheel_installs_into_a_clean_environment_and_runs_there(tmp_path):
    # The wheel of this checkout (its _C taken from the build `make` made: TORCH_MP_BUILD_DIR).
    dist_dir = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--quiet",
         "-w", str(dist_dir), str(ROOT)],
        tmp_path,
        TORCH_MP_BUILD_DIR=str(BUILD),
        PATH=f"{BIN}:{os.environ['PATH']}",
    )  # fmt: skip
    [wheel] = dist_dir.glob("torch_mp-*.whl")
    # A new environment that sees torch (this one's site-packages, as a plain path: its .pth
    # files, the editable torch_mp among them, are not read) but no torch_mp until installed.
    env = tmp_path / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)], tmp_path)
    python = env / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                tmp_path).strip()  # fmt: skip
    Path(site, "torch_from_dev_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    missing = subprocess.run([str(python), "-c", "import torch_mp"], cwd=tmp_path,
                             env=_clean_env(), capture_output=True)  # fmt: skip
    assert missing.returncode != 0
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet",
          str(wheel)], tmp_path)  # fmt: skip
    script = tmp_path / "smoke.py"
    script.write_text(SMOKE.replace("PATH", repr(str(tmp_path / "ckpt"))))
    out = _run(
        [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script)],
        tmp_path,
    )  # fmt: skip
    assert f"smoke OK from {site}/torch_mp/__init__.py" in out


def _readme_block(heading: str, language: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def consumers(tmp_path_factory) -> dict[str, Path]:
    """LibTorch applications built against an install prefix of this build: the C++ example
    tp_mlp (examples/cpp as its own project) and the README's C++ quick start (a plain CMake
    project that sets no C++ standard). Their two compilations run at once (one per core)."""
    root = tmp_path_factory.mktemp("consumers")
    prefix, source = root / "prefix", root / "readme"
    cmake = str(BIN / "cmake")
    _run([cmake, "--install", str(BUILD), "--prefix", str(prefix)], root)
    # The installed library finds torch's libraries by itself: loaded into a process that has
    # not imported torch (an application's own run path does not serve libtorch_mp's needs).
    library = prefix / "lib" / "libtorch_mp.so"
    _run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(library)!r})"], root)
    source.mkdir()
    (source / "main.cpp").write_text(_readme_block("## Quick start: C++", "cpp"))
    lines = _readme_block("## Quick start: C++", "cmake")
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(app CXX)\nadd_executable(app main.cpp)\n"
        + lines
    )
    projects = {"examples": (ROOT / "examples/cpp", ["--target", "tp_mlp"]), "readme": (source, [])}
    builds = {name: root / f"build-{name}" for name in projects}
    for name, (project, _) in projects.items():
        _run(
            [cmake, "-S", str(project), "-B", str(builds[name]), "-G", "Ninja",
             f"-DCMAKE_MAKE_PROGRAM={BIN / 'ninja'}",
             f"-DCMAKE_PREFIX_PATH={prefix};{torch.utils.cmake_prefix_path}"],
            root,
        )  # fmt: skip
    running = {
        name: subprocess.Popen(
            [cmake, "--build", str(builds[name]), *target],
            cwd=root,
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for name, (_, target) in projects.items()
    }
    for name, process in running.items():
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, f"{name}:\n{output}"
    return builds


def test_a_libtorch_application_built_against_the_install_prefix_runs(consumers):
    out = _run(
        [str(BIN / "torchrun"), "--standalone", "--no-python", "--nproc-per-node=2",
         str(consumers["examples"] / "tp_mlp")],
        ROOT,
    )  # fmt: skip
    assert "OK: largest difference" in out


def test_the_readme_cpp_quick_start_builds_as_a_consumer_project_and_runs(consumers):
    """The README's C++ snippet and its two CMake lines, extracted (not copied), in a plain
    CMake project that sets no C++ standard, built against an install prefix and run as the
    snippet's first line says."""
    code = _readme_block("## Quick start: C++", "cpp")
    launch = code.splitlines()[0].removeprefix("// ").split()
    assert launch[:2] == ["torchrun", "--no-python"] and launch[-1] == "./app", launch
    _run([str(BIN / "torchrun"), "--standalone", *launch[1:]], consumers["readme"])
