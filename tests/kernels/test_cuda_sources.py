"""Every CUDA kernel source compiles for sm_80 and sm_90 through NVRTC, with no GPU.

NVRTC is the compiler CuPy uses at run time. Its Python bindings (cuda-bindings), the
library (nvidia-cuda-nvrtc) and the fp16/bf16 headers (nvidia-cuda-runtime) install from
PyPI on a machine without a driver; when they are missing these tests FAIL and say what
to install, since a skipped compile check would let a broken kernel through CI.
"""

from __future__ import annotations

import re

import pytest

from pagedkernels import nvrtc_check
from pagedkernels.cuda_sources import CHECK_ARCHS, all_builds, expand_source


def _require_nvrtc() -> None:
    try:
        nvrtc_check.nvrtc_version()
        nvrtc_check.include_options()
    except nvrtc_check.NvrtcUnavailable as exc:
        pytest.fail(f"NVRTC is needed to check the CUDA kernels: {exc}")


@pytest.mark.parametrize("arch", CHECK_ARCHS)
@pytest.mark.parametrize("build", all_builds(), ids=lambda b: b.label())
def test_kernel_source_compiles(build, arch: str) -> None:
    _require_nvrtc()
    result = nvrtc_check.compile_build(build, arch, verbose_ptxas=True)  # raises with the log
    assert result.cubin_bytes > 0
    # A warning is a finding (an unused value, a narrowing), and a spill or a stack frame
    # puts local-memory traffic in a kernel whose whole cost is memory traffic: both fail
    # here, on every CI run, although no GPU is present.
    assert "warning" not in result.log, result.log
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", result.log)
    assert len(frames) == len(build.kernels), result.log
    assert all(stack == spill == "0" for stack, spill in frames), result.log


def test_compile_errors_carry_the_compiler_log() -> None:
    _require_nvrtc()
    broken = 'extern "C" __global__ void k(float* x) { x[0] = undeclared_name; }\n'
    with pytest.raises(nvrtc_check.KernelCompileError, match="undeclared_name"):
        nvrtc_check.compile_source(broken, "broken.cu", "sm_90", ["--std=c++17"])


def test_launch_source_is_self_contained() -> None:
    # CuPy caches compiled kernels by their code: local headers must be inlined into it.
    for build in all_builds():
        code = expand_source(build.path)
        assert '#include "ps_device.cuh"' not in code
        assert "cp_async16" in code or "kv_cache_write_impl" in code
