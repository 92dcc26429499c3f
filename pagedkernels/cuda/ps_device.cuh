// pagedserve device prelude: the few intrinsics the kernels use, behind small wrappers.
//
// On the GPU (NVRTC, sm_80 and newer) they are CUDA intrinsics and inline PTX. With
// PS_EMULATE defined the same kernel sources build as plain C++ for the CPU emulator
// (ps_emulate.h), which runs every thread of a CTA as a fiber so the tests can check
// indexing, masking and the split-K reduction without a GPU.
#pragma once

#if defined(PS_EMULATE)
#include "ps_emulate.h"
#else

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define PS_DEVICE __device__ __forceinline__
#define PS_KERNEL(max_threads) extern "C" __global__ void __launch_bounds__(max_threads)
#define PS_SHARED __shared__
#define PS_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#define PS_NEG_INF __int_as_float(0xff800000)

namespace ps {

typedef unsigned int u32;
typedef unsigned short u16;

PS_DEVICE void sync_threads() { __syncthreads(); }

PS_DEVICE float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
PS_DEVICE int shfl_up(int v, int delta) { return __shfl_up_sync(0xffffffffu, v, delta); }

// 16-byte global -> shared copy that bypasses L1; with pred false it writes 16 zero
// bytes and reads nothing (src must still be a valid address expression).
PS_DEVICE void cp_async16(void* smem_dst, const void* gmem_src, bool pred) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}
PS_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
PS_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices from shared memory: lane L gives the address of row L % 8 of
// matrix L / 8 (16 contiguous bytes). Without .trans lane t gets elements (t/4, 2(t%4))
// and (t/4, 2(t%4)+1) of matrix i in d[i]; with .trans (2(t%4), t/4) and (2(t%4)+1, t/4).
PS_DEVICE void ldmatrix_x4(u32 (&d)[4], const void* row_addr) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row_addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(a));
}
PS_DEVICE void ldmatrix_x4_trans(u32 (&d)[4], const void* row_addr) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row_addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(a));
}

PS_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct Scalar;

template <>
struct Scalar<__half> {
  static PS_DEVICE float to_float(__half x) { return __half2float(x); }
  static PS_DEVICE __half from_float(float x) { return __float2half_rn(x); }
  // Two floats as one 32-bit register: `lo` in the low half (the lower column / k index).
  static PS_DEVICE u32 pack2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
  }
  static PS_DEVICE float bits_to_float(u16 bits) { return __half2float(__ushort_as_half(bits)); }
  // D = A * B + D, A 16x16 row-major, B 16x8 column-major, fp32 accumulate.
  static PS_DEVICE void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Scalar<__nv_bfloat16> {
  static PS_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static PS_DEVICE __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static PS_DEVICE u32 pack2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
  }
  static PS_DEVICE float bits_to_float(u16 bits) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
  static PS_DEVICE void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

}  // namespace ps

#endif  // PS_EMULATE

namespace ps {
PS_DEVICE int imin(int a, int b) { return a < b ? a : b; }
PS_DEVICE int imax(int a, int b) { return a > b ? a : b; }
PS_DEVICE int ceil_div(int a, int b) { return (a + b - 1) / b; }
}  // namespace ps
