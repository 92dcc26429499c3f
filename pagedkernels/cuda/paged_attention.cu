// Paged attention over a mixed batch (decode, prefill, extend after a cached prefix) in
// one launch, with the semantics of pagedkernels.reference.paged_attention:
//
//   request b owns query rows query_start_loc[b] .. query_start_loc[b+1] (n_b rows) at
//   positions seq_lens[b]-n_b .. seq_lens[b]-1 and keys 0 .. seq_lens[b]-1 through
//   block_table[b]; a query at p reads keys k <= p, and with a window W only p - k < W.
//   Query head h reads kv head h / (Hq / Hkv). Rows past query_start_loc[B] are zeros.
//
// One build per (element type, head dim): the launcher compiles this file with
// -DPS_SCALAR=__half|__nv_bfloat16 and -DPS_HEAD_DIM=<one of cuda_sources.ATTENTION_HEAD_DIMS>
// (any multiple of 16 up to 256 works). fp32 accumulation throughout; tensor cores through mma.sync m16n8k16.
//
// Work split. A CTA (4 warps) owns one tile of BLOCK_M = 64 "rows", a row being one
// (query token, query head) pair of one request and one kv head: the heads of a GQA group
// are packed next to each other (row r = token r / G, head r % G for G heads per CTA), so
// K/V tiles loaded once into shared memory serve every head of the group; a decode step
// of a 4-head group fills 4 rows, a prefill tile 16 tokens x 4 heads.
//   blockIdx.x: tile; tiles are numbered request by request (ceil(n_b / tokens_per_tile)
//               each), found by a block-wide prefix scan over query_start_loc, so the grid
//               is sized from shapes alone and the launch needs no host synchronisation.
//               CTAs past the last tile only help zero the padding rows.
//   blockIdx.y: kv head * head_chunks + chunk of the group's heads (groups over 64 heads).
//   blockIdx.z: split of the tile's key range (flash-decoding). With num_splits > 1 each
//               CTA writes its normalised partial output and log2-sum-exp to fp32 scratch
//               and paged_attention_reduce merges them (and writes the padding zeros).
//
// Each CTA streams its keys in tiles of BLOCK_N through double-buffered shared memory
// (cp.async), computes S = Q K^T per warp (16 rows each), an online softmax in registers
// (log2 domain), and O += P V with P taken straight from the S accumulators.
#include "ps_device.cuh"

#ifndef PS_SCALAR
#define PS_SCALAR __half
#endif
#ifndef PS_HEAD_DIM
#define PS_HEAD_DIM 128
#endif

namespace ps {

typedef PS_SCALAR scalar_t;
typedef Scalar<scalar_t> SC;

constexpr int HEAD_DIM = PS_HEAD_DIM;
static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim must be a multiple of 16, <= 256");
constexpr int NUM_WARPS = 4;
constexpr int THREADS = NUM_WARPS * 32;
constexpr int BLOCK_M = NUM_WARPS * 16;
constexpr int BLOCK_N = HEAD_DIM > 128 ? 32 : 64;
constexpr int SMEM_PITCH = HEAD_DIM + 8;  // elements; the 16-byte pad spreads rows over banks
constexpr int CHUNKS = HEAD_DIM / 8;      // 16-byte chunks per row
constexpr int N_TILES_D = HEAD_DIM / 8;   // 8-wide MMA tiles along head_dim
constexpr int N_TILES_K = BLOCK_N / 8;    // 8-wide MMA tiles along keys
constexpr int KEY_WARPS = BLOCK_N / 16;   // warps sharing a key tile in key mode
static_assert(KEY_WARPS <= NUM_WARPS, "key mode gives each warp 16 keys of a tile");
static_assert(KEY_WARPS * 16 * (HEAD_DIM + 2) * 4 <= 4 * BLOCK_N * SMEM_PITCH * 2,
              "the key-mode merge reuses the K/V stages");
// Dynamic shared memory, in bytes (the launcher computes the same number).
constexpr int SMEM_BYTES = (BLOCK_M + 4 * BLOCK_N) * SMEM_PITCH * 2;
static_assert(SMEM_BYTES <= 160 * 1024, "must fit an sm_80 CTA (163 KiB opt-in)");

struct AttnParams {
  const scalar_t* q;
  long long q_tok, q_head;  // element strides of query [T, Hq, D]
  const scalar_t* k_cache;
  const scalar_t* v_cache;
  long long k_block, k_tok, k_head;  // element strides of key_cache [NB, BS, Hkv, D]
  long long v_block, v_tok, v_head;
  const int* block_table;
  long long bt_row;
  const int* query_start_loc;
  const int* seq_lens;
  scalar_t* out;  // contiguous [T, Hq, D]
  float* part_o;  // [splits, T, Hq, D] when num_splits > 1
  float* part_lse;  // [splits, T, Hq]
  int num_reqs, num_tokens, num_q_heads, num_kv_heads, block_size;
  int block_shift;   // log2(block_size) when it is a power of two, else -1
  float scale_log2;  // scale * log2(e)
  float cap_scale;   // scale / soft_cap, or 0 without a cap
  float cap_log2;    // soft_cap * log2(e)
  int window;        // 0: no sliding window
  int num_splits, tokens_per_tile, heads_per_cta, head_chunks;
};

// Zero query rows [total, num_tokens) for this CTA's heads (padding rows).
PS_DEVICE void zero_padding_rows(const AttnParams& p, int total, int head_begin, int head_count) {
  const int pad = p.num_tokens - total;
  if (pad <= 0) return;
  const long long per_token = (long long)head_count * HEAD_DIM;
  for (int t = total + blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    scalar_t* row = p.out + ((long long)t * p.num_q_heads + head_begin) * HEAD_DIM;
    for (long long i = threadIdx.x; i < per_token; i += THREADS) row[i] = SC::from_float(0.f);
  }
}

// Online-softmax state of the two rows (gid, gid + 8) a thread holds in one warp's tile.
struct RowState {
  float o_acc[N_TILES_D][4];
  float row_max[2];
  float row_sum[2];  // this thread's share; summed over the quad at the end
  PS_DEVICE void init() {
    for (int j = 0; j < N_TILES_D; ++j) {
      for (int e = 0; e < 4; ++e) o_acc[j][e] = 0.f;
    }
    row_max[0] = row_max[1] = PS_NEG_INF;
    row_sum[0] = row_sum[1] = 0.f;
  }
};

struct TileCtx {
  float scale_log2, cap_scale, cap_log2;
  int window, key_end, pos_lo, pos_hi;
  int pos0, pos1;  // positions of this thread's two rows (-1: padding row)
};

// One warp, 16 rows, NT*8 keys starting at key0 (rows of ks / vs): S = Q K^T, masked
// online softmax in the log2 domain, O += P V.
template <int NT>
PS_DEVICE void tile_step(const TileCtx& c, RowState& st, const scalar_t* q_rows,
                         const scalar_t* ks, const scalar_t* vs, int key0) {
  static_assert(NT % 2 == 0, "P V steps take 16 keys");
  const int lane = threadIdx.x & 31;
  const int tig = lane & 3;
  float s[NT][4];
  for (int j = 0; j < NT; ++j) {
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
  }
  // ldmatrix row addresses of this lane (matrix m = lane / 8, its row lane % 8).
  const int m = lane >> 3;
  const scalar_t* k_lane = ks + ((m >> 1) * 8 + (lane & 7)) * SMEM_PITCH + (m & 1) * 8;
  const scalar_t* v_lane = vs + ((m & 1) * 8 + (lane & 7)) * SMEM_PITCH + (m >> 1) * 8;
  const scalar_t* q_row0 = q_rows;
  const scalar_t* q_row1 = q_rows + 8 * SMEM_PITCH;
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
    u32 a[4];
    a[0] = *reinterpret_cast<const u32*>(q_row0 + kk * 16);
    a[1] = *reinterpret_cast<const u32*>(q_row1 + kk * 16);
    a[2] = *reinterpret_cast<const u32*>(q_row0 + kk * 16 + 8);
    a[3] = *reinterpret_cast<const u32*>(q_row1 + kk * 16 + 8);
    // K's B fragments for key tiles j, j+1: matrices (keys of tile j, dims lo / hi) and
    // (tile j+1, lo / hi); K rows are B's columns, so no transpose.
    for (int j = 0; j < NT; j += 2) {
      u32 b[4];
      ldmatrix_x4(b, k_lane + j * 8 * SMEM_PITCH + kk * 16);
      SC::mma16816(s[j], a, b[0], b[1]);
      SC::mma16816(s[j + 1], a, b[2], b[3]);
    }
  }

  // Scale (and cap) into the log2 domain; mask what a row may not see. A tile every row
  // sees whole (in range, causal, inside the window) skips the mask.
  const int key_last = key0 + NT * 8 - 1;
  const bool full_tile = key_last < c.key_end && key_last <= c.pos_lo &&
                         (c.window == 0 || c.pos_hi - key0 < c.window);
  float tile_max[2] = {PS_NEG_INF, PS_NEG_INF};
  for (int j = 0; j < NT; ++j) {
    for (int e = 0; e < 4; ++e) {
      float x = s[j][e];
      x = c.cap_scale > 0.f ? c.cap_log2 * tanhf(x * c.cap_scale) : x * c.scale_log2;
      if (!full_tile) {
        const int key = key0 + j * 8 + tig * 2 + (e & 1);
        const int pos = (e >> 1) ? c.pos1 : c.pos0;
        const bool visible =
            key < c.key_end && key <= pos && (c.window == 0 || pos - key < c.window);
        if (!visible) x = PS_NEG_INF;
      }
      s[j][e] = x;
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
    }
  }
  float alpha[2];
  float m_use[2];
  for (int i = 0; i < 2; ++i) {
    float m = tile_max[i];
    m = fmaxf(m, shfl_xor(m, 1));
    m = fmaxf(m, shfl_xor(m, 2));
    const float m_new = fmaxf(st.row_max[i], m);
    m_use[i] = m_new == PS_NEG_INF ? 0.f : m_new;  // a row with nothing visible yet
    alpha[i] = fast_exp2(st.row_max[i] - m_use[i]);
    st.row_max[i] = m_new;
    st.row_sum[i] *= alpha[i];
  }
  for (int j = 0; j < N_TILES_D; ++j) {
    st.o_acc[j][0] *= alpha[0];
    st.o_acc[j][1] *= alpha[0];
    st.o_acc[j][2] *= alpha[1];
    st.o_acc[j][3] *= alpha[1];
  }
  for (int j = 0; j < NT; ++j) {
    for (int e = 0; e < 4; ++e) {
      const float pr = fast_exp2(s[j][e] - m_use[e >> 1]);
      s[j][e] = pr;
      st.row_sum[e >> 1] += pr;
    }
  }

  // O += P V: the S accumulators of key tiles 2k, 2k+1 are exactly the A fragment of a
  // 16-key step; V's B fragment pairs two consecutive keys of one column, which the
  // transposing ldmatrix gathers: matrices (keys lo / hi, dims of tile j) and (tile j+1).
  for (int kk = 0; kk < NT / 2; ++kk) {
    u32 a[4];
    a[0] = SC::pack2(s[2 * kk][0], s[2 * kk][1]);
    a[1] = SC::pack2(s[2 * kk][2], s[2 * kk][3]);
    a[2] = SC::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = SC::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    for (int j = 0; j < N_TILES_D; j += 2) {
      u32 b[4];
      ldmatrix_x4_trans(b, v_lane + kk * 16 * SMEM_PITCH + j * 8);
      SC::mma16816(st.o_acc[j], a, b[0], b[1]);
      SC::mma16816(st.o_acc[j + 1], a, b[2], b[3]);
    }
  }
}

// One element of a finished row: the output (one split) or the split's partial, with the
// row's log2-sum-exp written once (write_lse).
PS_DEVICE void write_row_value(const AttnParams& p, long long t, int h, int split, int d,
                               float value, bool write_lse, float lse) {
  if (p.num_splits == 1) {
    p.out[(t * p.num_q_heads + h) * HEAD_DIM + d] = SC::from_float(value);
  } else {
    const long long row = ((long long)split * p.num_tokens + t) * p.num_q_heads + h;
    p.part_o[row * HEAD_DIM + d] = value;
    if (write_lse) p.part_lse[row] = lse;
  }
}

PS_DEVICE void attention_tile(const AttnParams& p) {
  PS_DYNAMIC_SMEM(smem_raw);
  scalar_t* q_s = reinterpret_cast<scalar_t*>(smem_raw);
  scalar_t* k_s = q_s + BLOCK_M * SMEM_PITCH;  // [2][BLOCK_N][SMEM_PITCH]
  scalar_t* v_s = k_s + 2 * BLOCK_N * SMEM_PITCH;
  PS_SHARED int s_warp_total[NUM_WARPS];
  PS_SHARED int s_req;
  PS_SHARED int s_tile_in_req;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int gid = lane >> 2;  // MMA row group
  const int tig = lane & 3;   // thread in group
  const int tile = blockIdx.x;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int kv_head = blockIdx.y / p.head_chunks;
  const int g0 = (blockIdx.y - kv_head * p.head_chunks) * p.heads_per_cta;
  const int g_count = imin(p.heads_per_cta, group - g0);
  const int split = blockIdx.z;
  const int tpt = p.tokens_per_tile;

  // ---- which request and which of its tiles is ours: prefix scan of tiles per request
  if (tid == 0) {
    s_req = -1;
    s_tile_in_req = 0;
  }
  int carry = 0;
  for (int base = 0; base < p.num_reqs; base += THREADS) {
    const int b = base + tid;
    int n_tiles = 0;
    if (b < p.num_reqs) {
      const int n = p.query_start_loc[b + 1] - p.query_start_loc[b];
      n_tiles = ceil_div(n, tpt);
    }
    int incl = n_tiles;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = shfl_up(incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) s_warp_total[warp] = incl;
    sync_threads();
    int total = 0;
    for (int w = 0; w < NUM_WARPS; ++w) {
      if (w < warp) incl += s_warp_total[w];
      total += s_warp_total[w];
    }
    incl += carry;
    if (n_tiles > 0 && tile >= incl - n_tiles && tile < incl) {
      s_req = b;
      s_tile_in_req = tile - (incl - n_tiles);
    }
    carry += total;
    sync_threads();  // publishes s_req; s_warp_total is rewritten next round
    if (carry > tile) break;  // the same in every thread
  }
  const int total_q = p.query_start_loc[p.num_reqs];
  if (p.num_splits == 1 && split == 0) {
    zero_padding_rows(p, total_q, kv_head * group + g0, g_count);
  }
  const int b = s_req;
  if (b < 0) return;  // the whole CTA

  // ---- this tile's rows, positions and key range
  const int q_begin = p.query_start_loc[b];
  const int n_b = p.query_start_loc[b + 1] - q_begin;
  const int seq_len = p.seq_lens[b];
  const int tok0 = s_tile_in_req * tpt;  // first query of the tile, within the request
  const int n_tok = imin(tpt, n_b - tok0);
  const int rows_valid = n_tok * g_count;
  const int pos_lo = seq_len - n_b + tok0;  // position of the tile's first query
  const int pos_hi = pos_lo + n_tok - 1;
  const int key_lo = p.window > 0 ? imax(0, pos_lo - p.window + 1) : 0;
  const int key_hi = pos_hi + 1;  // exclusive
  const int span = key_hi - key_lo;
  const int per_split = ceil_div(ceil_div(span, p.num_splits), BLOCK_N) * BLOCK_N;
  const int kb = key_lo + split * per_split;
  const int ke = imin(key_hi, kb + per_split);
  const int head_base = kv_head * group + g0;  // first query head of the CTA

  if (kb >= ke) {
    // An empty split (short context): mark its partials empty for the reduction.
    for (int r = tid; r < rows_valid; r += THREADS) {
      const long long t = q_begin + tok0 + r / g_count;
      const int h = head_base + r % g_count;
      p.part_lse[((long long)split * p.num_tokens + t) * p.num_q_heads + h] = PS_NEG_INF;
    }
    return;
  }

  // ---- Q tile -> shared (zeros for rows past the tile's end)
  for (int i = tid; i < BLOCK_M * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS;
    const int c = i - r * CHUNKS;
    const bool ok = r < rows_valid;
    const scalar_t* src = p.q;
    if (ok) {
      const long long t = q_begin + tok0 + r / g_count;
      const int h = head_base + r % g_count;
      src = p.q + t * p.q_tok + h * p.q_head + c * 8;
    }
    cp_async16(q_s + r * SMEM_PITCH + c * 8, src, ok);
  }

  const int* bt = p.block_table + (long long)b * p.bt_row;
  const long long k_off_head = (long long)kv_head * p.k_head;
  const long long v_off_head = (long long)kv_head * p.v_head;
  auto load_kv = [&](int stage, int key_start) {
    scalar_t* ks = k_s + stage * BLOCK_N * SMEM_PITCH;
    scalar_t* vs = v_s + stage * BLOCK_N * SMEM_PITCH;
    for (int i = tid; i < BLOCK_N * CHUNKS; i += THREADS) {
      const int r = i / CHUNKS;
      const int c = i - r * CHUNKS;
      const int key = key_start + r;
      const bool ok = key < ke;
      const scalar_t* k_src = p.k_cache;
      const scalar_t* v_src = p.v_cache;
      if (ok) {
        // A power-of-two block size (the usual case) spares an integer division per chunk.
        const int page = p.block_shift >= 0 ? key >> p.block_shift : key / p.block_size;
        const long long blk = bt[page];
        const long long off = key - page * p.block_size;
        k_src = p.k_cache + blk * p.k_block + off * p.k_tok + k_off_head + c * 8;
        v_src = p.v_cache + blk * p.v_block + off * p.v_tok + v_off_head + c * 8;
      }
      // Keys past the range are zero-filled, never read: a stale or NaN slot must not
      // reach the P V product, where 0 * NaN would poison the row.
      cp_async16(ks + r * SMEM_PITCH + c * 8, k_src, ok);
      cp_async16(vs + r * SMEM_PITCH + c * 8, v_src, ok);
    }
  };

  // Two layouts of the 4 warps over a tile:
  //  - row mode (more than 16 rows): warp w owns rows 16w .. 16w+15 and every key;
  //  - key mode (at most 16 rows: decode, or a few extend tokens of a large group):
  //    every warp owns rows 0..15 and its own 16 keys of each key tile, so all warps do
  //    math instead of one; the warps' softmax states merge through shared memory.
  const bool key_mode = rows_valid <= 16;  // the same in every thread of the CTA
  const int row_base = key_mode ? 0 : warp * 16;
  const bool warp_active = key_mode ? warp < KEY_WARPS : row_base < rows_valid;
  int row_pos[2];
  for (int i = 0; i < 2; ++i) {
    const int r = row_base + gid + 8 * i;
    row_pos[i] = r < rows_valid ? pos_lo + r / g_count : -1;  // -1: sees nothing
  }
  RowState st;
  st.init();
  const TileCtx ctx{p.scale_log2, p.cap_scale, p.cap_log2, p.window, ke, pos_lo, pos_hi,
                    row_pos[0], row_pos[1]};
  const scalar_t* q_rows = q_s + (row_base + gid) * SMEM_PITCH + tig * 2;

  const int n_key_tiles = ceil_div(ke - kb, BLOCK_N);
  load_kv(0, kb);
  cp_async_commit();

  for (int kt = 0; kt < n_key_tiles; ++kt) {
    const int key_start = kb + kt * BLOCK_N;
    if (kt + 1 < n_key_tiles) {
      load_kv((kt + 1) & 1, key_start + BLOCK_N);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    sync_threads();
    if (warp_active) {
      const scalar_t* ks = k_s + (kt & 1) * BLOCK_N * SMEM_PITCH;
      const scalar_t* vs = v_s + (kt & 1) * BLOCK_N * SMEM_PITCH;
      if (key_mode) {
        const int off = warp * 16;
        tile_step<2>(ctx, st, q_rows, ks + off * SMEM_PITCH, vs + off * SMEM_PITCH,
                     key_start + off);
      } else {
        tile_step<N_TILES_K>(ctx, st, q_rows, ks, vs, key_start);
      }
    }
    sync_threads();  // the stage just read is refilled by the next iteration's load
  }

  if (warp_active) {
    for (int i = 0; i < 2; ++i) {
      float l = st.row_sum[i];
      l += shfl_xor(l, 1);
      l += shfl_xor(l, 2);
      st.row_sum[i] = l;
    }
  }

  if (key_mode) {
    // Merge the warps' states through the (now idle) K/V stages:
    // red_o [KEY_WARPS][16][HEAD_DIM], red_m and red_l [KEY_WARPS][16].
    float* red_o = reinterpret_cast<float*>(k_s);
    float* red_m = red_o + KEY_WARPS * 16 * HEAD_DIM;
    float* red_l = red_m + KEY_WARPS * 16;
    if (warp_active) {
      for (int i = 0; i < 2; ++i) {
        const int r = warp * 16 + gid + 8 * i;
        float* dst = red_o + r * HEAD_DIM + tig * 2;
        for (int j = 0; j < N_TILES_D; ++j) {
          dst[j * 8] = st.o_acc[j][2 * i];
          dst[j * 8 + 1] = st.o_acc[j][2 * i + 1];
        }
        if (tig == 0) {
          red_m[r] = st.row_max[i];
          red_l[r] = st.row_sum[i];
        }
      }
    }
    sync_threads();
    for (int idx = tid; idx < rows_valid * HEAD_DIM; idx += THREADS) {
      const int r = idx / HEAD_DIM;
      const int d = idx - r * HEAD_DIM;
      float m = PS_NEG_INF;
      for (int w = 0; w < KEY_WARPS; ++w) m = fmaxf(m, red_m[w * 16 + r]);
      float l = 0.f;
      float o = 0.f;
      if (m != PS_NEG_INF) {
        for (int w = 0; w < KEY_WARPS; ++w) {
          const float scale = fast_exp2(red_m[w * 16 + r] - m);
          l += scale * red_l[w * 16 + r];
          o += scale * red_o[(w * 16 + r) * HEAD_DIM + d];
        }
      }
      write_row_value(p, q_begin + tok0 + r / g_count, head_base + r % g_count, split, d,
                      l > 0.f ? o / l : 0.f, d == 0, l > 0.f ? m + log2f(l) : PS_NEG_INF);
    }
    return;
  }

  if (!warp_active) return;
  for (int i = 0; i < 2; ++i) {
    const int r = row_base + gid + 8 * i;
    if (r >= rows_valid) continue;
    const long long t = q_begin + tok0 + r / g_count;
    const int h = head_base + r % g_count;
    const float l = st.row_sum[i];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (p.num_splits == 1) {
      scalar_t* dst = p.out + (t * p.num_q_heads + h) * HEAD_DIM + tig * 2;
      for (int j = 0; j < N_TILES_D; ++j) {
        *reinterpret_cast<u32*>(dst + j * 8) =
            SC::pack2(st.o_acc[j][2 * i] * inv, st.o_acc[j][2 * i + 1] * inv);
      }
    } else {
      const long long row = ((long long)split * p.num_tokens + t) * p.num_q_heads + h;
      float* dst = p.part_o + row * HEAD_DIM + tig * 2;
      for (int j = 0; j < N_TILES_D; ++j) {
        dst[j * 8] = st.o_acc[j][2 * i] * inv;
        dst[j * 8 + 1] = st.o_acc[j][2 * i + 1] * inv;
      }
      if (tig == 0) p.part_lse[row] = l > 0.f ? st.row_max[i] + log2f(l) : PS_NEG_INF;
    }
  }
}

// Merge the splits of one (token, query head): out = sum_s w_s O_s / sum_s w_s with
// w_s = 2^(lse_s - max lse). Rows past query_start_loc[num_reqs] are written as zeros.
// Grid: num_tokens * num_q_heads CTAs of HEAD_DIM threads.
PS_DEVICE void attention_reduce(const float* __restrict__ part_o,
                                const float* __restrict__ part_lse, scalar_t* __restrict__ out,
                                const int* __restrict__ query_start_loc, int num_reqs,
                                int num_tokens, int num_q_heads, int num_splits) {
  const int t = blockIdx.x / num_q_heads;
  const int h = blockIdx.x - t * num_q_heads;
  const int d = threadIdx.x;
  const long long row = (long long)t * num_q_heads + h;
  if (t >= query_start_loc[num_reqs]) {
    out[row * HEAD_DIM + d] = SC::from_float(0.f);
    return;
  }
  const long long split_stride = (long long)num_tokens * num_q_heads;
  float lse_max = PS_NEG_INF;
  for (int s = 0; s < num_splits; ++s) lse_max = fmaxf(lse_max, part_lse[s * split_stride + row]);
  float acc = 0.f;
  float weight = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float lse = part_lse[s * split_stride + row];
    if (lse == PS_NEG_INF) continue;  // empty split: its part_o was never written
    const float w = fast_exp2(lse - lse_max);
    weight += w;
    acc += w * part_o[(s * split_stride + row) * HEAD_DIM + d];
  }
  out[row * HEAD_DIM + d] = SC::from_float(acc / weight);
}

}  // namespace ps

PS_KERNEL(128)
paged_attention(const ps::scalar_t* q, long long q_tok, long long q_head,
                const ps::scalar_t* k_cache, const ps::scalar_t* v_cache, long long k_block,
                long long k_tok, long long k_head, long long v_block, long long v_tok,
                long long v_head, const int* block_table, long long bt_row,
                const int* query_start_loc, const int* seq_lens, ps::scalar_t* out,
                float* part_o, float* part_lse, int num_reqs, int num_tokens, int num_q_heads,
                int num_kv_heads, int block_size, int block_shift, float scale_log2, float cap_scale,
                float cap_log2, int window, int num_splits, int tokens_per_tile,
                int heads_per_cta, int head_chunks) {
  ps::AttnParams p;
  p.q = q;
  p.q_tok = q_tok;
  p.q_head = q_head;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.k_block = k_block;
  p.k_tok = k_tok;
  p.k_head = k_head;
  p.v_block = v_block;
  p.v_tok = v_tok;
  p.v_head = v_head;
  p.block_table = block_table;
  p.bt_row = bt_row;
  p.query_start_loc = query_start_loc;
  p.seq_lens = seq_lens;
  p.out = out;
  p.part_o = part_o;
  p.part_lse = part_lse;
  p.num_reqs = num_reqs;
  p.num_tokens = num_tokens;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.block_size = block_size;
  p.block_shift = block_shift;
  p.scale_log2 = scale_log2;
  p.cap_scale = cap_scale;
  p.cap_log2 = cap_log2;
  p.window = window;
  p.num_splits = num_splits;
  p.tokens_per_tile = tokens_per_tile;
  p.heads_per_cta = heads_per_cta;
  p.head_chunks = head_chunks;
  ps::attention_tile(p);
}

PS_KERNEL(256)
paged_attention_reduce(const float* part_o, const float* part_lse, ps::scalar_t* out,
                       const int* query_start_loc, int num_reqs, int num_tokens,
                       int num_q_heads, int num_splits) {
  ps::attention_reduce(part_o, part_lse, out, query_start_loc, num_reqs, num_tokens,
                       num_q_heads, num_splits);
}
