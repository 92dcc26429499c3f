// CPU emulation of the little of CUDA the pagedserve kernels use, for tests without a GPU.
//
// Each CTA runs its threads as fibers (ucontext) on one OS thread, CTAs one after
// another. __syncthreads parks a fiber until every live thread of the CTA arrives; warp
// operations (shuffles, mma.sync) park it until all 32 lanes of its warp arrive, then each
// lane reads the others' registers from an exchange buffer. A barrier that can never
// complete (divergent __syncthreads, a shuffle some lanes skip) is reported as a deadlock
// instead of hanging. cp.async copies stay pending until cp.async.wait_group retires
// their group, so a read of shared memory before the wait sees stale bytes, and their
// global source addresses are checked against the buffers the caller registered.
//
// Included by ps_device.cuh when PS_EMULATE is defined; built with g++ -std=c++17.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#define PS_DEVICE inline
#define PS_KERNEL(max_threads) extern "C" void
#define PS_SHARED static
#define PS_DYNAMIC_SMEM(name) unsigned char* name = psemu::emu().dyn_smem.data()
#define PS_NEG_INF (-INFINITY)

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

namespace psemu {

struct Dim3 {
  unsigned x, y, z;
};

enum State { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };

struct Copy {
  void* dst;
  const void* src;
  bool pred;
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  State state = RUNNABLE;
  int xphase = 0;
  std::vector<Copy> open;
  std::vector<std::vector<Copy>> groups;
};

struct Range {
  uintptr_t begin, end;
};

constexpr int XWORDS = 8;  // exchange words per lane per warp operation

struct Emu {
  Dim3 block_idx{0, 0, 0}, block_dim{1, 1, 1}, grid_dim{1, 1, 1};
  int cur = -1;
  std::vector<Fiber> fibers;
  ucontext_t sched;
  std::vector<unsigned char> dyn_smem;
  std::vector<uint32_t> xbuf[2];
  std::function<void()> body;
  std::vector<Range> ranges;
  std::string error;
};

inline Emu& emu() {
  static Emu e;
  return e;
}

inline void fail(const std::string& msg) {
  Emu& e = emu();
  if (e.error.empty()) e.error = msg;
}

inline Dim3 thread_idx() { return Dim3{(unsigned)emu().cur, 0, 0}; }

inline void park(State s) {
  Emu& e = emu();
  Fiber& f = e.fibers[e.cur];
  f.state = s;
  swapcontext(&f.ctx, &e.sched);
}

inline void fiber_entry() {
  Emu& e = emu();
  e.body();
  e.fibers[e.cur].state = DONE;  // uc_link returns to the scheduler
}

// Run one CTA of `n` threads to completion; false on deadlock.
inline bool run_cta(int n) {
  Emu& e = emu();
  const size_t stack_bytes = 256 * 1024;
  e.fibers.clear();
  e.fibers.resize(n);
  const int warps = (n + 31) / 32;
  for (auto& x : e.xbuf) x.assign((size_t)warps * 32 * XWORDS, 0u);
  for (int i = 0; i < n; ++i) {
    Fiber& f = e.fibers[i];
    f.stack.resize(stack_bytes);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = stack_bytes;
    f.ctx.uc_link = &e.sched;
    makecontext(&f.ctx, (void (*)())fiber_entry, 0);
  }
  // Threads run in a scrambled order that changes every pass, so that a read of shared
  // memory that another thread writes without a barrier in between is likely to see the
  // wrong bytes (for power-of-two CTAs the stride 37 visits every thread once).
  unsigned pass = 0;
  for (;;) {
    const int start = (int)((pass++ * 13u) % (unsigned)n);
    const int stride = n % 37 == 0 ? 1 : 37;
    for (int k = 0; k < n; ++k) {
      const int i = (int)((start + (long long)k * stride) % n);
      if (e.fibers[i].state != RUNNABLE) continue;
      e.cur = i;
      swapcontext(&e.sched, &e.fibers[i].ctx);
    }
    int done = 0, at_block = 0;
    bool released = false;
    for (int w = 0; w < warps; ++w) {
      const int lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
      int waiting = 0;
      for (int i = lo; i < hi; ++i) waiting += e.fibers[i].state == AT_WARP_BARRIER;
      if (waiting == hi - lo) {
        for (int i = lo; i < hi; ++i) e.fibers[i].state = RUNNABLE;
        released = true;
      }
    }
    for (auto& f : e.fibers) {
      done += f.state == DONE;
      at_block += f.state == AT_BLOCK_BARRIER;
    }
    if (done == n) return true;
    if (!released && at_block > 0 && at_block + done == n) {
      for (auto& f : e.fibers) {
        if (f.state == AT_BLOCK_BARRIER) f.state = RUNNABLE;
      }
      released = true;
    }
    if (!released) {
      std::string states;
      for (int i = 0; i < n; ++i) states += "0BWD"[e.fibers[i].state];
      fail("deadlock in CTA (" + std::to_string(e.block_idx.x) + "," +
           std::to_string(e.block_idx.y) + "," + std::to_string(e.block_idx.z) +
           "), thread states (0 run, B block barrier, W warp op, D done): " + states);
      return false;
    }
  }
}

template <typename... A, size_t... I>
void call_with(void (*f)(A...), void** argv, std::index_sequence<I...>) {
  f(*static_cast<std::remove_reference_t<A>*>(argv[I])...);
}

template <typename... A>
int launch(void (*f)(A...), unsigned gx, unsigned gy, unsigned gz, unsigned bx, size_t smem,
           void** argv) {
  Emu& e = emu();
  e.error.clear();
  e.grid_dim = Dim3{gx, gy, gz};
  e.block_dim = Dim3{bx, 1, 1};
  e.body = [&]() { call_with(f, argv, std::index_sequence_for<A...>{}); };
  for (unsigned z = 0; z < gz; ++z) {
    for (unsigned y = 0; y < gy; ++y) {
      for (unsigned x = 0; x < gx; ++x) {
        e.block_idx = Dim3{x, y, z};
        // Fresh shared memory per CTA, filled with a pattern a missing load would show.
        e.dyn_smem.assign(smem + 16, 0xA5);
        if (!run_cta((int)bx)) return 1;
        if (!e.error.empty()) return 1;
      }
    }
  }
  return 0;
}

// -- warp exchange ---------------------------------------------------------------------
inline uint32_t* xslot(int phase, int lane_of_warp) {
  Emu& e = emu();
  const int warp = e.cur / 32;
  return e.xbuf[phase].data() + ((size_t)warp * 32 + lane_of_warp) * XWORDS;
}

template <typename V>
V exchange(V v, int src_lane_fn_xor, int src_lane_up, bool up) {
  static_assert(sizeof(V) <= 4 * XWORDS, "exchange value too large");
  Emu& e = emu();
  Fiber& f = e.fibers[e.cur];
  const int lane = e.cur & 31;
  const int phase = f.xphase;
  std::memcpy(xslot(phase, lane), &v, sizeof(V));
  park(AT_WARP_BARRIER);
  int src = up ? lane - src_lane_up : (lane ^ src_lane_fn_xor);
  if (src < 0) src = lane;  // __shfl_up: lanes below delta keep their value
  V r;
  std::memcpy(&r, xslot(phase, src), sizeof(V));
  e.fibers[e.cur].xphase ^= 1;
  return r;
}

// -- fp16 / bf16 -------------------------------------------------------------------------
inline uint16_t f32_to_f16_bits(float x) {
  _Float16 h = (_Float16)x;  // round to nearest even
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
inline float f16_bits_to_f32(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return (float)h;
}
inline uint16_t f32_to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return (uint16_t)(u >> 16);
}
inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline bool in_ranges(const void* p, size_t n) {
  const uintptr_t a = (uintptr_t)p;
  for (const Range& r : emu().ranges) {
    if (a >= r.begin && a + n <= r.end) return true;
  }
  return false;
}

}  // namespace psemu

#define threadIdx (psemu::thread_idx())
#define blockIdx (psemu::emu().block_idx)
#define blockDim (psemu::emu().block_dim)
#define gridDim (psemu::emu().grid_dim)

namespace ps {

typedef unsigned int u32;
typedef unsigned short u16;

inline void sync_threads() { psemu::park(psemu::AT_BLOCK_BARRIER); }
inline float shfl_xor(float v, int mask) { return psemu::exchange(v, mask, 0, false); }
inline int shfl_up(int v, int delta) { return psemu::exchange(v, 0, delta, true); }

inline void cp_async16(void* smem_dst, const void* gmem_src, bool pred) {
  psemu::Emu& e = psemu::emu();
  const unsigned char* lo = e.dyn_smem.data();
  const unsigned char* d = static_cast<const unsigned char*>(smem_dst);
  if (d < lo || d + 16 > lo + e.dyn_smem.size() - 16) {
    psemu::fail("cp.async destination outside dynamic shared memory");
    return;  // never write outside the buffer
  }
  if (((uintptr_t)gmem_src & 15u) != 0 || ((uintptr_t)smem_dst & 15u) != 0) {
    psemu::fail("cp.async address not 16-byte aligned");
  }
  if (pred && !psemu::in_ranges(gmem_src, 16)) {
    char msg[128];
    std::snprintf(msg, sizeof msg, "cp.async reads %p, outside every registered buffer",
                  gmem_src);
    psemu::fail(msg);
    pred = false;
  }
  e.fibers[e.cur].open.push_back(psemu::Copy{smem_dst, gmem_src, pred});
}
inline void cp_async_commit() {
  psemu::Fiber& f = psemu::emu().fibers[psemu::emu().cur];
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
template <int N>
inline void cp_async_wait() {
  psemu::Fiber& f = psemu::emu().fibers[psemu::emu().cur];
  while ((int)f.groups.size() > N) {
    for (const psemu::Copy& c : f.groups.front()) {
      if (c.pred) {
        std::memcpy(c.dst, c.src, 16);
      } else {
        std::memset(c.dst, 0, 16);
      }
    }
    f.groups.erase(f.groups.begin());
  }
}

// ldmatrix.m8n8.x4 (.trans): lane L supplies row L % 8 of matrix L / 8.
inline void ldmatrix_x4_impl(u32 (&d)[4], const void* row_addr, bool trans) {
  psemu::Emu& e = psemu::emu();
  const int lane = e.cur & 31;
  const int phase = e.fibers[e.cur].xphase;
  const uintptr_t addr = (uintptr_t)row_addr;
  std::memcpy(psemu::xslot(phase, lane), &addr, sizeof addr);
  const unsigned char* lo = e.dyn_smem.data();
  if ((const unsigned char*)row_addr < lo ||
      (const unsigned char*)row_addr + 16 > lo + e.dyn_smem.size() - 16 || (addr & 15u) != 0) {
    psemu::fail("ldmatrix row address outside shared memory or not 16-byte aligned");
  }
  psemu::park(psemu::AT_WARP_BARRIER);
  auto elem = [&](int m, int row, int col) {
    uintptr_t a;
    std::memcpy(&a, psemu::xslot(phase, m * 8 + row), sizeof a);
    if (a < (uintptr_t)lo || a + 16 > (uintptr_t)(lo + e.dyn_smem.size())) return 0u;
    uint16_t v;
    std::memcpy(&v, (const void*)(a + 2 * col), 2);
    return (u32)v;
  };
  const int g = lane / 4, t = lane % 4;
  for (int m = 0; m < 4; ++m) {
    d[m] = trans ? elem(m, 2 * t, g) | (elem(m, 2 * t + 1, g) << 16)
                 : elem(m, g, 2 * t) | (elem(m, g, 2 * t + 1) << 16);
  }
  e.fibers[e.cur].xphase ^= 1;
}
inline void ldmatrix_x4(u32 (&d)[4], const void* row_addr) { ldmatrix_x4_impl(d, row_addr, false); }
inline void ldmatrix_x4_trans(u32 (&d)[4], const void* row_addr) {
  ldmatrix_x4_impl(d, row_addr, true);
}

inline float fast_exp2(float x) { return exp2f(x); }

template <typename T>
struct Scalar;

template <typename T, float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
struct EmuScalar {
  static T make(uint16_t b) {
    T t;
    t.bits = b;
    return t;
  }
  static float to_float(T x) { return ToF(x.bits); }
  static T from_float(float x) { return make(FromF(x)); }
  static u32 pack2(float lo, float hi) { return (u32)FromF(lo) | ((u32)FromF(hi) << 16); }
  static float bits_to_float(u16 bits) { return ToF(bits); }
  // mma.sync.m16n8k16 row.col, fp32 accumulate, with the PTX fragment layout:
  // A: a[0] = (row g, k 2t..2t+1), a[1] = (row g+8, same k), a[2] = (row g, k+8),
  //    a[3] = (row g+8, k+8); B: b0 = (k 2t..2t+1, col g), b1 = (k+8); C/D: d[0..1] =
  //    (row g, cols 2t..2t+1), d[2..3] = (row g+8); g = lane / 4, t = lane % 4.
  static void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    psemu::Emu& e = psemu::emu();
    const int lane = e.cur & 31;
    const int phase = e.fibers[e.cur].xphase;
    uint32_t* mine = psemu::xslot(phase, lane);
    mine[0] = a[0];
    mine[1] = a[1];
    mine[2] = a[2];
    mine[3] = a[3];
    mine[4] = b0;
    mine[5] = b1;
    psemu::park(psemu::AT_WARP_BARRIER);
    auto elem = [](u32 reg, int k) { return ToF((uint16_t)(k & 1 ? reg >> 16 : reg & 0xffff)); };
    auto A = [&](int row, int k) {
      const uint32_t* src = psemu::xslot(phase, (row % 8) * 4 + (k % 8) / 2);
      const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      return elem(src[reg], k);
    };
    auto B = [&](int k, int col) {
      const uint32_t* src = psemu::xslot(phase, col * 4 + (k % 8) / 2);
      return elem(src[k >= 8 ? 5 : 4], k);
    };
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0);
      const int col = 2 * t + (i & 1);
      float acc = 0.f;
      for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
      d[i] += acc;
    }
    e.fibers[e.cur].xphase ^= 1;
  }
};

template <>
struct Scalar<__half> : EmuScalar<__half, psemu::f16_bits_to_f32, psemu::f32_to_f16_bits> {};
template <>
struct Scalar<__nv_bfloat16>
    : EmuScalar<__nv_bfloat16, psemu::bf16_bits_to_f32, psemu::f32_to_bf16_bits> {};

}  // namespace ps

#define PS_EMU_EXPORT(kernel)                                                             \
  extern "C" int emu_##kernel(unsigned gx, unsigned gy, unsigned gz, unsigned bx,         \
                              unsigned long long smem, void** argv) {                     \
    return psemu::launch(kernel, gx, gy, gz, bx, (size_t)smem, argv);                     \
  }

extern "C" const char* emu_error() { return psemu::emu().error.c_str(); }
extern "C" void emu_clear_ranges() { psemu::emu().ranges.clear(); }
extern "C" void emu_add_range(unsigned long long begin, unsigned long long nbytes) {
  psemu::emu().ranges.push_back(psemu::Range{(uintptr_t)begin, (uintptr_t)(begin + nbytes)});
}
