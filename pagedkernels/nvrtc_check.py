"""Compile every CUDA kernel source with NVRTC, no GPU needed: what CI runs.

NVRTC is the compiler CuPy uses at run time, so a source that compiles here for sm_80 and
sm_90 is the source the launchers will load. The Python bindings come from `cuda-bindings`
(module cuda.bindings.nvrtc), the compiler library from `nvidia-cuda-nvrtc` and the
cuda_fp16.h / cuda_bf16.h headers from `nvidia-cuda-runtime`; none of them needs a driver.

    python -m pagedkernels.nvrtc_check            # every build, sm_80 and sm_90
    python -m pagedkernels.nvrtc_check -v         # with ptxas register / spill report
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from pagedkernels.cuda_sources import CHECK_ARCHS, KernelBuild, all_builds, base_options
from pagedkernels.cuda_sources import cuda_include_dirs as _cuda_include_dirs

INSTALL_HINT = (
    "pip install 'cuda-bindings>=13,<14' 'nvidia-cuda-nvrtc>=13,<14' 'nvidia-cuda-runtime>=13,<14'"
)


class NvrtcUnavailable(RuntimeError):
    """The NVRTC bindings, library or CUDA headers are missing."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


@dataclass
class CompileResult:
    build: KernelBuild
    arch: str
    cubin_bytes: int
    log: str
    seconds: float


def _nvrtc():  # -> module cuda.bindings.nvrtc
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise NvrtcUnavailable(
            f"the NVRTC Python bindings are not importable ({exc}); install them with: "
            f"{INSTALL_HINT}"
        ) from exc
    try:
        err, _major, _minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the bindings load libnvrtc lazily
        raise NvrtcUnavailable(
            f"libnvrtc could not be loaded ({exc}); install it with: {INSTALL_HINT}"
        ) from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcUnavailable(f"nvrtcVersion failed: {err}")
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    _, major, minor = _nvrtc().nvrtcVersion()
    return int(major), int(minor)


def include_options() -> list[str]:
    dirs = _cuda_include_dirs()
    if not dirs:
        raise NvrtcUnavailable(
            "cuda_fp16.h / cuda_bf16.h not found (NVRTC has no default include path); "
            f"install the CUDA runtime headers with: {INSTALL_HINT}"
        )
    return [f"-I{dirs[0]}"]


def _check(nvrtc, result, what: str) -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelCompileError(f"{what} failed: {result}")


def compile_source(
    code: str, name: str, arch: str, options: list[str], verbose_ptxas: bool = False
) -> tuple[int, str]:
    """Compile CUDA C `code` to a CUBIN for `arch`; return (cubin size, log) or raise.

    The error carries NVRTC's log, so a CI failure shows the compiler's message.
    """
    nvrtc = _nvrtc()
    opts = [*options, *include_options(), f"--gpu-architecture={arch}"]
    if verbose_ptxas:
        opts.append("--ptxas-options=-v")
    err, prog = nvrtc.nvrtcCreateProgram(code.encode(), name.encode(), 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in opts]
        (compile_err,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        err, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
        _check(nvrtc, err, "nvrtcGetProgramLogSize")
        log_buf = b" " * log_size
        (err,) = nvrtc.nvrtcGetProgramLog(prog, log_buf)
        log = log_buf.rstrip(b"\x00 ").decode(errors="replace")
        if compile_err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(
                f"NVRTC failed to compile {name} for {arch} ({compile_err}):\n{log}"
            )
        err, cubin_size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err, "nvrtcGetCUBINSize")
        if cubin_size == 0:
            raise KernelCompileError(f"{name} for {arch}: empty CUBIN")
        return int(cubin_size), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_build(build: KernelBuild, arch: str, verbose_ptxas: bool = False) -> CompileResult:
    """Compile one build for `arch` (e.g. 'sm_90'); raise KernelCompileError with the log."""
    start = time.perf_counter()
    options = [*base_options(), *build.define_options()]
    size, log = compile_source(build.code(), build.label(), arch, options, verbose_ptxas)
    return CompileResult(build, arch, size, log, time.perf_counter() - start)


def check_all(
    archs: tuple[str, ...] = CHECK_ARCHS, verbose_ptxas: bool = False
) -> list[CompileResult]:
    """Compile every build for every arch; the first failure raises KernelCompileError."""
    return [compile_build(b, a, verbose_ptxas) for b in all_builds() for a in archs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="e.g. sm_90 (repeatable)")
    parser.add_argument("-v", "--verbose", action="store_true", help="ptxas resource usage")
    args = parser.parse_args(argv)
    archs = tuple(args.arch) if args.arch else CHECK_ARCHS
    major, minor = nvrtc_version()
    print(f"NVRTC {major}.{minor}, headers from {include_options()[0][2:]}")
    try:
        results = check_all(archs, args.verbose)
    except KernelCompileError as exc:
        print(exc, file=sys.stderr)
        return 1
    for r in results:
        print(f"ok  {r.arch}  {r.build.label()}  cubin {r.cubin_bytes} B  {r.seconds:.1f}s")
        if args.verbose and r.log.strip():
            print("    " + r.log.strip().replace("\n", "\n    "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
