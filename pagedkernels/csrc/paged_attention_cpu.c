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
   Everything is float32; half-precision caches are widened as they are read. */

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

#define TILE 256
#define MAX_HEAD_DIM 512
/* Queries of one request attended together (more run in groups of this many): a
   speculative verify's K + 1 <= 33, with room for short extends. */
#define MAX_QUERIES 64
/* Items per thread worth splitting a request's heads for (load balance vs locality). */
#define ITEMS_PER_THREAD 4

enum { PS_F32 = 0, PS_BF16 = 1, PS_F16 = 2 };

/* One cache: its base and strides, in elements. */
typedef struct {
    const char *base;
    int64_t block, slot, head;
} ps_cache;

/* What every work item of one call shares. Strides are in elements. */
typedef struct {
    ps_cache k, v;
    int64_t q_tok, q_head, out_tok, out_head;
    int block_size, group, window;
    float scale, soft_cap;
} ps_call;

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

/* Scratch of one thread: scores [rows * TILE], acc [rows * d], running max and sum
   [rows], one widened row [d]; rows = queries x the query heads of one work item. */
typedef struct {
    float *scores, *acc, *max, *sum, *widened, *alpha;
    float *spare; /* [d]: where the fast path's padding rows add their zeros */
    float *partials; /* [heads * 16 * 16], 64-byte aligned: a decode group's partial dot products */
} ps_scratch;

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

typedef void (*ps_attend_fn)(const ps_call *, int, int, const float *, float *,
                             const int32_t *, int, int, int, int, ps_scratch *);

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

#if defined __AVX512F__
#include <immintrin.h>

/* libmvec's 16-lane expf (glibc's AVX-512 variant). */
__m512 _ZGVeN16v_expf(__m512);

/* The decode fast path: one float32 query, head size D a multiple of 16, G query heads per
   kv head, no soft cap, blocks a multiple of 16 slots. The generic copy above computes a
   dot product and its horizontal sum per key and query head, and adds each value into an
   accumulator in memory: from cache it is bound by that arithmetic, not by the bytes.
   Here keys go 16 slots at a time: 16 partial dot products in registers summed together
   by one transposing reduction (lane s of the result is slot s's score), one 16-lane
   exponential for the group's probabilities, and the values added into accumulators held
   in registers, G query heads per value row read. The 16 slots are walked block by block,
   all of an item's kv heads per group, so K/V are still read in memory order. */

/* Lane i of the result is the sum of the lanes of p[i]. Each stage adds halves of the same
   vectors, so a NaN in one slot's partial (a slot past the request's keys) stays in its
   own lane, which the caller masks. The stages leave the lanes in the order SIGMA (an
   involution), so the inputs go in in that order. */
static inline __m512 ps_sum16(const __m512 p[16]) {
    static const int sigma[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    __m512 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++)
        a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(p[sigma[j]], p[sigma[j + 8]], 0x44),
                             _mm512_shuffle_f32x4(p[sigma[j]], p[sigma[j + 8]], 0xEE));
    for (int j = 0; j < 4; j++)
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 4], 0x88),
                             _mm512_shuffle_f32x4(a[j], a[j + 4], 0xDD));
    for (int j = 0; j < 2; j++)
        c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[j], b[j + 2], 0x44),
                             _mm512_shuffle_ps(b[j], b[j + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

#ifndef PS_AHEAD
#define PS_AHEAD 2
#endif
#ifndef PS_LOC
#define PS_LOC 1
#endif
/* The first row of the group PS_AHEAD groups after `start` (NULL past the last key): its
   rows are read ahead, one slot's per slot computed, into L2 (into L1 they evict the
   group at work). The hardware prefetcher stops at each 4 KiB page, and blocks lie
   anywhere. */
static inline const char *ps_ahead(const float *base, int64_t block_stride, int64_t slot,
                                   const int32_t *table, int start, int last_key, int bs) {
    const int next = start + 16 * PS_AHEAD;
    if (next > last_key) return NULL;
    return (const char *)(base + table[next / bs] * block_stride + (next % bs) * slot);
}

static inline void ps_prefetch_row(const char *row, int64_t bytes) {
    if (row == NULL) return;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, PS_LOC);
}

/* The keys of [start, start + 16) that lie in [first_key, last_key], as a lane mask. */
static inline __mmask16 ps_lanes(int start, int first_key, int last_key, int *lo, int *hi) {
    *lo = first_key > start ? first_key - start : 0;
    *hi = last_key - start < 15 ? last_key - start : 15;
    return (__mmask16)(((1u << (*hi + 1)) - 1) & ~((1u << *lo) - 1));
}

/* The attention of nq consecutive queries of one request, as ps_attend (same arguments),
   on the fast path. multi 0 is the plain decode's copy (one query, no mask per query). */
static inline __attribute__((always_inline)) void ps_fast_attend(
    const ps_call *c, const int D, const int G, const int multi, const int nq, const float *q,
    float *out, const int32_t *table, int first_key, int last_key, int h0, int nh,
    ps_scratch *w) {
    static const float zeros[TILE] __attribute__((aligned(64)));
    const int bs = c->block_size, heads = nh * G, rows = nq * heads;
    const int first_pos = last_key - nq + 1, window = c->window;
    const int64_t ks = c->k.slot, vs = c->v.slot;
    const int64_t row_bytes = ((int64_t)(nh - 1) * c->k.head + D) * 4;
    const float *kbase = (const float *)c->k.base + h0 * c->k.head;
    const float *vbase = (const float *)c->v.base + h0 * c->v.head;
    float *acc = w->acc, *m = w->max, *l = w->sum;
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * rows * D);
    const __m512 scale = _mm512_set1_ps(c->scale), neg_inf = _mm512_set1_ps(-INFINITY);
    for (int tile = first_key & ~15; tile <= last_key; tile += TILE) {
        const int tile_end = tile + TILE - 1 < last_key ? tile + TILE - 1 : last_key;
        /* Scores, 16 keys at a time, into scores[r * TILE + key - tile]. */
        for (int start = tile; start <= tile_end; start += 16) {
            const float *kb = kbase + table[start / bs] * c->k.block + (start % bs) * ks;
            const char *ahead = ps_ahead(kbase, c->k.block, ks, table, start, last_key, bs);
            if (!multi) {
                /* One query: slot by slot, every head of it (memory order), one partial
                   vector per query head, the next group's rows read ahead a slot's at a
                   time (all at once stalls on the misses in flight). */
                int lo, hi;
                const __mmask16 valid = ps_lanes(start, first_key, last_key, &lo, &hi);
                __m512 *part = (__m512 *)w->partials;
                for (int s = 0; s < 16; s++) {
                    const float *ksl = kb + s * ks;
                    ps_prefetch_row(ahead == NULL ? NULL : ahead + s * ks * 4, row_bytes);
                    for (int h = 0; h < nh; h++) {
                        const float *kh = ksl + h * c->k.head;
                        for (int g = 0; g < G; g++) {
                            const float *qr = q + (int64_t)(h * G + g) * c->q_head;
                            __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qr), _mm512_loadu_ps(kh));
                            for (int i = 16; i < D; i += 16)
                                dot = _mm512_fmadd_ps(_mm512_loadu_ps(qr + i), _mm512_loadu_ps(kh + i), dot);
                            part[(h * G + g) * 16 + s] = dot;
                        }
                    }
                }
                for (int r = 0; r < rows; r++)
                    _mm512_storeu_ps(w->scores + r * TILE + (start - tile),
                                     _mm512_mask_mov_ps(neg_inf, valid,
                                                        _mm512_mul_ps(ps_sum16(part + r * 16), scale)));
                continue;
            }
            /* Several queries: each query head's 16 partials in registers, the group's rows
               read from L1 once per query head. */
            for (int s = 0; s < 16 && ahead != NULL; s++) ps_prefetch_row(ahead + s * ks * 4, row_bytes);
            for (int qi = 0; qi < nq; qi++) {
                int lo, hi;
                const int pos = first_pos + qi;
                const int fk = window > 0 && pos - window + 1 > first_key ? pos - window + 1 : first_key;
                const __mmask16 valid = fk > start + 15 || pos < start
                                            ? 0
                                            : ps_lanes(start, fk, pos, &lo, &hi);
                for (int h = 0; h < nh; h++) {
                    const float *kh = kb + h * c->k.head;
                    for (int g = 0; g < G; g++) {
                        const int r = qi * heads + h * G + g;
                        float *dst = w->scores + r * TILE + (start - tile);
                        if (valid == 0) {
                            _mm512_storeu_ps(dst, neg_inf);
                            continue;
                        }
                        const float *qr = q + qi * c->q_tok + (int64_t)(h * G + g) * c->q_head;
                        __m512 part[16];
                        for (int s = 0; s < 16; s++) part[s] = _mm512_setzero_ps();
                        for (int i = 0; i < D; i += 16) {
                            const __m512 qv = _mm512_loadu_ps(qr + i);
                            for (int s = 0; s < 16; s++)
                                part[s] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kh + s * ks + i), part[s]);
                        }
                        _mm512_storeu_ps(dst, _mm512_mask_mov_ps(neg_inf, valid,
                                                                 _mm512_mul_ps(ps_sum16(part), scale)));
                    }
                }
            }
        }
        /* The tile's probabilities, and the running sums rescaled to its maximum. */
        const int padded = (tile_end - tile + 16) & ~15;
        for (int r = 0; r < rows; r++) {
            float *sc = w->scores + r * TILE;
            __m512 top = neg_inf;
            for (int j = 0; j < padded; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(sc + j));
            const float tile_max = _mm512_reduce_max_ps(top);
            const float new_max = tile_max > m[r] ? tile_max : m[r];
            if (multi && new_max == -INFINITY) {
                /* No key of this query yet (its window starts past the tile): nothing to
                   add, and exp(-inf - -inf) would be NaN. */
                memset(sc, 0, sizeof(float) * padded);
                w->alpha[r] = 1.0f;
                continue;
            }
            const __m512 nm = _mm512_set1_ps(new_max);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < padded; j += 16) {
                const __m512 p = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(sc + j), nm));
                _mm512_storeu_ps(sc + j, p);
                sum = _mm512_add_ps(sum, p);
            }
            const float alpha = expf(m[r] - new_max);  /* the first tile: exp(-inf) = 0 */
            m[r] = new_max;
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
            w->alpha[r] = alpha;  /* applied to the accumulators as the values' pass loads them */
        }
        /* Values, 16 keys at a time, into accumulators held in registers over a group, CH
           rows at a time (one head's query heads of one query, or of several). */
        for (int start = tile; start <= tile_end; start += 16) {
            int lo, hi;
            ps_lanes(start, first_key, last_key, &lo, &hi);
            const float *vb = vbase + table[start / bs] * c->v.block + (start % bs) * vs;
            const char *ahead = ps_ahead(vbase, c->v.block, vs, table, start, last_key, bs);
            for (int s = 0; s < 16 && ahead != NULL; s++) ps_prefetch_row(ahead + s * vs * 4, row_bytes);
            const int j0 = start - tile, per_head = nq * G;
            enum { CH = 8 };
            const int ch = multi ? CH : G;
            for (int h = 0; h < nh; h++) {
                const float *vh = vb + h * c->v.head;
                for (int k0 = 0; k0 < per_head; k0 += ch) {
                    const float *prob[CH];
                    float *dst[CH];
                    __m512 alpha[CH];
                    for (int t = 0; t < ch; t++) {
                        const int k = k0 + t, r = (k / G) * heads + h * G + k % G;
                        /* Past the last row: a zero probability into the spare row. */
                        prob[t] = k < per_head ? w->scores + r * TILE + j0 : zeros;
                        dst[t] = k < per_head ? acc + r * D : w->spare;
                        alpha[t] = _mm512_set1_ps(k < per_head && start == tile ? w->alpha[r] : 1.0f);
                    }
                    for (int i = 0; i < D; i += 16) {
                        __m512 a[CH];
                        for (int t = 0; t < ch; t++) a[t] = _mm512_mul_ps(_mm512_loadu_ps(dst[t] + i), alpha[t]);
                        /* Only the request's slots: past them a value may be NaN (0 * NaN). */
                        for (int s = lo; s <= hi; s++) {
                            const __m512 v = _mm512_loadu_ps(vh + s * vs + i);
                            for (int t = 0; t < ch; t++)
                                a[t] = _mm512_fmadd_ps(_mm512_set1_ps(prob[t][s]), v, a[t]);
                        }
                        for (int t = 0; t < ch; t++) _mm512_storeu_ps(dst[t] + i, a[t]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        float *o = out + (r / heads) * c->out_tok + (r % heads) * c->out_head;
        for (int i = 0; i < D; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + i), inv));
    }
}

#define PS_FAST_COPY(D, G)                                                                   \
    static void ps_fast_##D##_##G##_1(const ps_call *c, int d, int nq, const float *q,      \
                                      float *out, const int32_t *table, int first_key,      \
                                      int last_key, int h0, int nh, ps_scratch *w) {        \
        (void)d;                                                                             \
        (void)nq;                                                                            \
        ps_fast_attend(c, D, G, 0, 1, q, out, table, first_key, last_key, h0, nh, w);       \
    }                                                                                        \
    static void ps_fast_##D##_##G##_n(const ps_call *c, int d, int nq, const float *q,      \
                                      float *out, const int32_t *table, int first_key,      \
                                      int last_key, int h0, int nh, ps_scratch *w) {        \
        (void)d;                                                                             \
        ps_fast_attend(c, D, G, 1, nq, q, out, table, first_key, last_key, h0, nh, w);      \
    }
#define PS_FAST_GROUPS(D) \
    PS_FAST_COPY(D, 1)    \
    PS_FAST_COPY(D, 2)    \
    PS_FAST_COPY(D, 3)    \
    PS_FAST_COPY(D, 4)    \
    PS_FAST_COPY(D, 5)    \
    PS_FAST_COPY(D, 6)    \
    PS_FAST_COPY(D, 7)    \
    PS_FAST_COPY(D, 8)
PS_FAST_GROUPS(64)
PS_FAST_GROUPS(128)

#define PS_FAST_PAIR(D, G) {ps_fast_##D##_##G##_1, ps_fast_##D##_##G##_n}
static const ps_attend_fn ps_fast[2][8][2] = {
    {PS_FAST_PAIR(64, 1), PS_FAST_PAIR(64, 2), PS_FAST_PAIR(64, 3), PS_FAST_PAIR(64, 4),
     PS_FAST_PAIR(64, 5), PS_FAST_PAIR(64, 6), PS_FAST_PAIR(64, 7), PS_FAST_PAIR(64, 8)},
    {PS_FAST_PAIR(128, 1), PS_FAST_PAIR(128, 2), PS_FAST_PAIR(128, 3), PS_FAST_PAIR(128, 4),
     PS_FAST_PAIR(128, 5), PS_FAST_PAIR(128, 6), PS_FAST_PAIR(128, 7), PS_FAST_PAIR(128, 8)},
};

/* Off only to measure the generic copies against these (ps_set_fast_copies). */
static int ps_fast_on = 1;

/* Whether the fast copies take this call: float32, no soft cap, 16-slot groups. */
static int ps_fast_fits(int dtype, int d, int group, int block_size, float soft_cap) {
    return ps_fast_on && dtype == PS_F32 && soft_cap <= 0.0f && block_size % 16 == 0 && group <= 8 &&
           (d == 64 || d == 128);
}

/* The fast copies for a call, or 0 where they do not apply. */
static int ps_pick_fast(const ps_call *c, int dtype, int d, ps_attend_fn fns[2]) {
    if (!ps_fast_fits(dtype, d, c->group, c->block_size, c->soft_cap)) return 0;
    fns[0] = ps_fast[d == 128][c->group - 1][0];
    fns[1] = ps_fast[d == 128][c->group - 1][1];
    return 1;
}
#else
static int ps_fast_fits(int dtype, int d, int group, int block_size, float soft_cap) {
    (void)dtype, (void)d, (void)group, (void)block_size, (void)soft_cap;
    return 0;
}

static int ps_pick_fast(const ps_call *c, int dtype, int d, ps_attend_fn fns[2]) {
    (void)c, (void)dtype, (void)d, (void)fns;
    return 0;
}
#endif

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
    if (!ps_pick_fast(&call, dtype, head_dim, attend)) ps_pick(dtype, head_dim, attend);
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
        w.partials = aligned_alloc(64, sizeof(float) * 256 * (num_q_heads + 1));
        if (mem == NULL || w.partials == NULL) {
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

/* Turns the fast copies off (0) or on (1) for this process: benchmarks compare the two. */
void ps_set_fast_copies(int on) {
#if defined __AVX512F__
    ps_fast_on = on;
#else
    (void)on;
#endif
}
