"""Each instruction set's path of the CPU kernels, on whatever CPU runs the tests: the kernels compiled for AVX2
alone (`JAXLLAMA_CPU_MARCH=x86-64-v3`: no AVX-512, no VNNI), as a first-generation Zen runs them, pass the products'
and attention's tests too, in a process of their own (a process loads one build). On an AVX2-only CPU the native
build is that build already."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TESTS = ["test_w8a8_matmul.py", "test_quantized_matmul.py", "test_matmul.py", "test_decode_attention.py"]


def _flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


FLAGS = _flags()
WIDER = {"avx512f", "avx512_vnni", "avx_vnni"} & FLAGS


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernels")
@pytest.mark.skipif(platform.machine() != "x86_64" or not {"avx2", "fma"} <= FLAGS, reason="not an AVX2 CPU")
@pytest.mark.skipif(not WIDER, reason="an AVX2-only CPU: the native build is the AVX2 one")
def test_the_avx2_build_passes_the_kernel_tests(tmp_path):
    env = {**os.environ, "JAXLLAMA_CPU_MARCH": "x86-64-v3", "JAXLLAMA_TEST_CACHE": str(tmp_path)}
    tests = [str(Path(__file__).parent / name) for name in TESTS]
    # the products' tests on the real model and the engine's over the kernels are left to the native build: the point
    # here is each tile's arithmetic
    only = "not smollm2 and not engine and not kernels_cache"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", only, *tests],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    built = list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
    assert len(built) == 1
    if shutil.which("objdump"):  # the build holds no AVX-512 register
        assert "zmm" not in subprocess.run(["objdump", "-d", str(built[0])], capture_output=True, text=True).stdout
