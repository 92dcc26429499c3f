/* Paged attention on the CPU, reading K/V in place through the block table.

   pagedkernels.reference.paged_attention's semantics for the rows of the requests it is given:
   request b's queries are rows query_start_loc[b] .. query_start_loc[b+1]-1 at positions
   ending at seq_lens[b]-1; a query at p reads keys max(0, p-window+1) .. p. The batched torch
   path (pagedkernels/cpu.py) gathers every key into a padded buffer first and reads it again in
   scaled_dot_product_attention; for a decode step that copy is most of the time, and this
   kernel reads each key and value once.

   Work items are a request and a range of its kv heads, spread over OpenMP threads: all of
   its heads when there are enough requests to keep every thread busy, so each block's slots
   are read front to back (a block is slots x heads x d contiguous: reading one head's rows
   of it at a stride stalled on memory, 3.0 ms where the same work from cache took 1.2).
   The library is loaded into a process that already holds torch, whose bundled libgomp has
   the same soname, so the threads are torch's own pool and torch.set_num_threads sizes them.

   For each request the keys are walked in tiles of TILE: the scores of the tile for every
   query head (each key read once for the query heads that share it), an online softmax that
   rescales the running sums when the tile's maximum grows, then the values of the tile.
   A request with several queries (a verify step's last token and its drafts, a short
   extend) runs them together, up to MAX_QUERIES: each key is read (and widened) once for
   all of them, and query j sees it only up to its own position (causal), so a verify of K
   drafts reads its K/V once, as a decode does, and adds only the K + 1 queries' arithmetic.
   One-query requests run a copy compiled without the mask: the plain decode's code. (A
   variant that copied 64-key tiles into scratch, K transposed, to drop the horizontal sum
   per key was slower at 2 to 9 queries: the transposing copy cost more than it saved.)
   Everything is float32; half-precision caches are widened as they are read.

   On a CPU with AVX-512, float32 calls of common head sizes run the copies in
   paged_attention_fast.c instead, for any number of queries (ps_pick_fast). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* libmvec's vector variants, which <math.h> declares only under -ffast-math (whose other
   licences we do not want): the softmax's exponentials become 16 at a time. */
#if defined __x86_64__
__attribute__((simd("notinbranch"))) float expf(float);
__attribute__((simd("notinbranch"))) float tanhf(float);
#endif

#include "paged_attention_cpu.h"

static inline float ps_load(const char *p, int dtype, int64_t i) {
    if (dtype == PS_F32) return ((const float *)p)[i];
    if (dtype == PS_BF16) {
        uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return (float)((const _Float16 *)p)[i];
}

/* One cache row of d elements as float32: in place for float32, else widened into buf. */
static inline const float *ps_widen(const char *row, int dtype, int d, float *buf) {
    if (dtype == PS_F32) return (const float *)row;
    for (int i = 0; i < d; i++) buf[i] = ps_load(row, dtype, i);
    return buf;
}


/* The keys from pos to the end of its block or to tile_end: returns how many, with the row
   of pos's head h0 and the same row of the next block (NULL past last_key), which is read
   ahead while this block is computed: the hardware prefetcher stops at each 4 KiB page,
   and blocks lie anywhere. */
static inline int ps_run(const ps_cache *m, const int32_t *table, int pos, int tile_end,
                         int last_key, int bs, int esize, int h0, const char **row,
                         const char **ahead) {
    const int slot = pos % bs, block = pos / bs;
    const int64_t offset = slot * m->slot + h0 * m->head;
    *row = m->base + (table[block] * m->block + offset) * esize;
    *ahead = (block + 1) * bs > last_key
                 ? NULL
                 : m->base + (table[block + 1] * m->block + offset) * esize;
    return bs - slot < tile_end - pos + 1 ? bs - slot : tile_end - pos + 1;
}

static inline void ps_prefetch(const char *ahead, int64_t at, int64_t bytes) {
    if (ahead == NULL) return;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + at + b, 0, 3);
}

/* The queries a key at pos is visible to, [*lo, *hi] of 0 .. nq-1: query j sits at
   first_pos + j and sees keys first_pos + j - window < key <= first_pos + j. */
static inline void ps_visible(int pos, int first_pos, int nq, int window, int *lo, int *hi) {
    const int j = pos - first_pos;
    *lo = j > 0 ? j : 0;
    *hi = window > 0 && j + window - 1 < nq - 1 ? j + window - 1 : nq - 1;
}

/* The attention of nq consecutive query rows of one request (positions last_key-nq+1 ..
   last_key) for query heads [h0 * group, (h0 + nh) * group), keys first_key .. last_key.
   Inlined into one copy per (cache dtype, head size, multi) below: with those constant,
   the loops over d are unrolled vector code, the dtype switch is gone, and the one-query
   copy (multi 0, nq 1) has no causal mask at all. Row r = query * heads + head. */
static inline __attribute__((always_inline)) void ps_attend(
    const ps_call *c, const int dtype, const int d, const int multi, const int nq,
    const float *q, float *out, const int32_t *table, int first_key, int last_key, int h0,
    int nh, ps_scratch *w) {
    const int group = c->group, heads = nh * group, bs = c->block_size, rows = nq * heads;
    const int esize = dtype == PS_F32 ? 4 : 2, first_pos = last_key - nq + 1;
    /* The bytes of one slot's heads h0 .. h0+nh-1 (contiguous when heads are dense). */
    const int64_t row_bytes = ((int64_t)(nh - 1) * c->k.head + d) * esize;
    for (int r = 0; r < rows; r++) {
        w->max[r] = -INFINITY;
        w->sum[r] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * rows * d);

    for (int tile_start = first_key; tile_start <= last_key; tile_start += TILE) {
        const int tile_end = tile_start + TILE - 1 < last_key ? tile_start + TILE - 1 : last_key;
        const int n = tile_end - tile_start + 1;

        /* Block by block (one table lookup each), slot by slot, head by head: memory order. */
        for (int pos = tile_start, count; pos <= tile_end; pos += count) {
            const char *row, *ahead;
            count = ps_run(&c->k, table, pos, tile_end, last_key, bs, esize, h0, &row, &ahead);
            for (int s = 0; s < count; s++, row += c->k.slot * esize) {
                const int j = pos - tile_start + s;
                int lo = 0, hi = 0;
                if (multi) ps_visible(pos + s, first_pos, nq, c->window, &lo, &hi);
                ps_prefetch(ahead, s * c->k.slot * esize, row_bytes);
                for (int h = 0; h < nh; h++) {
                    const float *k = ps_widen(row + h * c->k.head * esize, dtype, d, w->widened);
                    for (int qi = 0; qi < nq; qi++) {
                        for (int g = 0; g < group; g++) {
                            const int r = qi * heads + h * group + g;
                            if (multi && (qi < lo || qi > hi)) {
                                w->scores[r * TILE + j] = -INFINITY;
                                continue;
                            }
                            const float *qr = q + qi * c->q_tok + (h * group + g) * c->q_head;
                            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                            for (int i = 0; i < d; i++) dot += qr[i] * k[i];
                            dot *= c->scale;
                            /* Capped here, not in the tile pass below: that pass would turn
                               a masked -inf into -cap. */
                            if (multi && c->soft_cap > 0.0f)
                                dot = c->soft_cap * tanhf(dot / c->soft_cap);
                            w->scores[r * TILE + j] = dot;
                        }
                    }
                }
            }
        }

        for (int r = 0; r < rows; r++) {
            float *s = w->scores + r * TILE;
            if (!multi && c->soft_cap > 0.0f) {
                const float cap = c->soft_cap, inv = 1.0f / cap;
#pragma omp simd
                for (int j = 0; j < n; j++) s[j] = cap * tanhf(s[j] * inv);
            }
            float tile_max = -INFINITY;
            for (int j = 0; j < n; j++) tile_max = s[j] > tile_max ? s[j] : tile_max;
            const float new_max = tile_max > w->max[r] ? tile_max : w->max[r];
            /* A query that sees no key yet (a window's start past this tile): nothing to
               add, and exp(-inf - -inf) would be NaN. */
            if (multi && new_max == -INFINITY) continue;
            /* The first tile: exp(-inf) rescales the empty sums to 0. */
            const float rescale = expf(w->max[r] - new_max);
            w->max[r] = new_max;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < n; j++) {
                s[j] = expf(s[j] - new_max);
                sum += s[j];
            }
            w->sum[r] = w->sum[r] * rescale + sum;
            if (rescale != 1.0f) {
                float *a = w->acc + r * d;
#pragma omp simd
                for (int i = 0; i < d; i++) a[i] *= rescale;
            }
        }

        for (int pos = tile_start, count; pos <= tile_end; pos += count) {
            const char *row, *ahead;
            count = ps_run(&c->v, table, pos, tile_end, last_key, bs, esize, h0, &row, &ahead);
            for (int s = 0; s < count; s++, row += c->v.slot * esize) {
                const int j = pos - tile_start + s;
                int lo = 0, hi = nq - 1;
                if (multi) ps_visible(pos + s, first_pos, nq, c->window, &lo, &hi);
                ps_prefetch(ahead, s * c->v.slot * esize, row_bytes);
                for (int h = 0; h < nh; h++) {
                    const float *v = ps_widen(row + h * c->v.head * esize, dtype, d, w->widened);
                    for (int qi = lo; qi <= hi; qi++) {
                        for (int g = 0; g < group; g++) {
                            const int r = qi * heads + h * group + g;
                            const float p = w->scores[r * TILE + j];
                            float *a = w->acc + r * d;
#pragma omp simd
                            for (int i = 0; i < d; i++) a[i] += p * v[i];
                        }
                    }
                }
            }
        }
    }

    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / w->sum[r];
        float *o = out + (r / heads) * c->out_tok + (r % heads) * c->out_head;
        const float *a = w->acc + r * d;
#pragma omp simd
        for (int i = 0; i < d; i++) o[i] = a[i] * inv;
    }
}


/* D_ARG is the head size a copy computes with: a constant, or its argument d. The _1 copy
   is the plain decode (one query, nq ignored), the _n copy any query count. */
#define PS_SPECIALIZE(NAME, DTYPE, D_ARG)                                                    \
    static void NAME##_1(const ps_call *c, int d, int nq, const float *q, float *out,        \
                         const int32_t *table, int first_key, int last_key, int h0, int nh,  \
                         ps_scratch *w) {                                                    \
        (void)d;                                                                             \
        (void)nq;                                                                            \
        ps_attend(c, DTYPE, D_ARG, 0, 1, q, out, table, first_key, last_key, h0, nh, w);    \
    }                                                                                        \
    static void NAME##_n(const ps_call *c, int d, int nq, const float *q, float *out,        \
                         const int32_t *table, int first_key, int last_key, int h0, int nh,  \
                         ps_scratch *w) {                                                    \
        (void)d;                                                                             \
        ps_attend(c, DTYPE, D_ARG, 1, nq, q, out, table, first_key, last_key, h0, nh, w);   \
    }
#define PS_FOR_DTYPES(D, SUFFIX)                       \
    PS_SPECIALIZE(ps_attend_f32_##SUFFIX, PS_F32, D)   \
    PS_SPECIALIZE(ps_attend_bf16_##SUFFIX, PS_BF16, D) \
    PS_SPECIALIZE(ps_attend_f16_##SUFFIX, PS_F16, D)

/* The head sizes of common models (and the tests' 16 and 32) get unrolled copies; any
   other size runs the same code with d a variable. */
PS_FOR_DTYPES(16, 16)
PS_FOR_DTYPES(32, 32)
PS_FOR_DTYPES(64, 64)
PS_FOR_DTYPES(80, 80)
PS_FOR_DTYPES(96, 96)
PS_FOR_DTYPES(128, 128)
PS_FOR_DTYPES(256, 256)
PS_FOR_DTYPES(d, any)


/* The copies for one dtype and head size: [0] one query, [1] several. */
static void ps_pick(int dtype, int d, ps_attend_fn fns[2]) {
#define PS_SET(D)                                                                    \
    do {                                                                             \
        fns[0] = dtype == PS_F32    ? ps_attend_f32_##D##_1                          \
                 : dtype == PS_BF16 ? ps_attend_bf16_##D##_1                         \
                                    : ps_attend_f16_##D##_1;                         \
        fns[1] = dtype == PS_F32    ? ps_attend_f32_##D##_n                          \
                 : dtype == PS_BF16 ? ps_attend_bf16_##D##_n                         \
                                    : ps_attend_f16_##D##_n;                         \
    } while (0)
#define PS_CASE(D) \
    case D:        \
        PS_SET(D); \
        return;
    switch (d) {
        PS_CASE(16)
        PS_CASE(32)
        PS_CASE(64)
        PS_CASE(80)
        PS_CASE(96)
        PS_CASE(128)
        PS_CASE(256)
    }
    PS_SET(any);
#undef PS_CASE
#undef PS_SET
}

/* Threads a parallel region started by the calling thread gets. */
static int ps_max_threads_now(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Returns 0, or a negative code for arguments the kernel cannot take (the Python side
   checks them first; this is the last line). */
int ps_paged_attention(const float *query, int64_t q_tok_stride, int64_t q_head_stride,
                       const void *key_cache, int64_t k_block_stride, int64_t k_slot_stride,
                       int64_t k_head_stride, const void *value_cache, int64_t v_block_stride,
                       int64_t v_slot_stride, int64_t v_head_stride, int dtype,
                       const int32_t *block_table, int64_t table_stride, const int32_t *reqs,
                       int num_reqs, const int32_t *query_start_loc, const int32_t *seq_lens,
                       int num_q_heads, int num_kv_heads, int head_dim, int block_size,
                       float scale, int window, float soft_cap, float *out,
                       int64_t out_tok_stride, int64_t out_head_stride) {
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || block_size <= 0) return -1;
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM || dtype < PS_F32 || dtype > PS_F16) return -2;
    const ps_call call = {
        {(const char *)key_cache, k_block_stride, k_slot_stride, k_head_stride},
        {(const char *)value_cache, v_block_stride, v_slot_stride, v_head_stride},
        q_tok_stride, q_head_stride, out_tok_stride, out_head_stride,
        block_size, num_q_heads / num_kv_heads, window,
        scale, soft_cap,
    };
    ps_attend_fn attend[2];
    const int fast = ps_pick_fast(&call, dtype, head_dim, attend);
    if (!fast) ps_pick(dtype, head_dim, attend);
    /* Work items: a group of up to MAX_QUERIES consecutive queries of one request (each
       attending the keys up to its last query) and a range of kv heads. A long prompt is
       several groups, so its attention spreads over the threads; its last groups (the
       most keys) are listed first, so they are not left to the end. */
    int groups = 0;
    for (int i = 0; i < num_reqs; i++) {
        const int n = query_start_loc[reqs[i] + 1] - query_start_loc[reqs[i]];
        groups += (n + MAX_QUERIES - 1) / MAX_QUERIES;
    }
    int32_t *work = malloc(sizeof(int32_t) * 2 * (groups > 0 ? groups : 1));
    if (work == NULL) return -3;
    for (int i = 0, k = 0; i < num_reqs; i++) {
        const int b = reqs[i], start = query_start_loc[b], end = query_start_loc[b + 1];
        for (int row = start + (end - start - 1) / MAX_QUERIES * MAX_QUERIES; row >= start && end > start; row -= MAX_QUERIES, k++) {
            work[2 * k] = b;
            work[2 * k + 1] = row;
        }
    }
    /* The fewest head ranges per group (a divisor of the kv heads) that still give every
       thread a few items. */
    int splits = 1;
    while (splits < num_kv_heads &&
           (num_kv_heads % splits != 0 ||
            groups * splits < ITEMS_PER_THREAD * ps_max_threads_now()))
        splits++;
    const int nh = num_kv_heads / splits, items = groups * splits;
    const int heads = nh * call.group;
    int most_queries = 1;
    for (int i = 0; i < num_reqs; i++) {
        const int n = query_start_loc[reqs[i] + 1] - query_start_loc[reqs[i]];
        most_queries = n > most_queries ? n : most_queries;
    }
    const size_t rows = (size_t)heads * (most_queries < MAX_QUERIES ? most_queries : MAX_QUERIES);
    int failed = 0;

#pragma omp parallel
    {
        ps_scratch w;
        float *mem = malloc(sizeof(float) * (rows * (TILE + head_dim + 3) + 2 * head_dim));
        /* The fast copies' decode partials; the generic copies need none. */
        w.partials = fast ? aligned_alloc(64, sizeof(float) * 256 * (num_q_heads + 1)) : NULL;
        if (mem == NULL || (fast && w.partials == NULL)) {
#pragma omp atomic write
            failed = 1;
        } else {
            w.scores = mem;
            w.acc = w.scores + rows * TILE;
            w.max = w.acc + rows * head_dim;
            w.sum = w.max + rows;
            w.widened = w.sum + rows;
            w.spare = w.widened + head_dim;
            w.alpha = w.spare + head_dim;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < items; item++) {
                const int b = work[2 * (item / splits)], row = work[2 * (item / splits) + 1];
                const int h0 = (item % splits) * nh;
                const int start = query_start_loc[b], end = query_start_loc[b + 1];
                const int nq = end - row < MAX_QUERIES ? end - row : MAX_QUERIES;
                const int pos = seq_lens[b] - (end - start) + (row - start);  /* its first */
                const int first_key = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                const int64_t q0 = (int64_t)h0 * call.group;
                attend[nq > 1](&call, head_dim, nq, query + row * q_tok_stride + q0 * q_head_stride,
                               out + row * out_tok_stride + q0 * out_head_stride,
                               block_table + b * table_stride, first_key, pos + nq - 1, h0, nh, &w);
            }
        }
        free(mem);
        free(w.partials);
    }
    free(work);
    return failed ? -3 : 0;
}

/* The OpenMP runtime's thread count for a region the calling thread starts: the loader
   checks it equals torch.get_num_threads() (one runtime, shared). */
int ps_max_threads(void) { return ps_max_threads_now(); }

/* 1 where calls with these arguments run the fast copies (any number of queries): float32,
   head size 64 or 128, at most 8 query heads per kv head, blocks of a multiple of 16 slots,
   no soft cap, and a build for a CPU with AVX-512. */
int ps_fast_path(int dtype, int head_dim, int group, int block_size, float soft_cap) {
    return ps_fast_fits(dtype, head_dim, group, block_size, soft_cap);
}

