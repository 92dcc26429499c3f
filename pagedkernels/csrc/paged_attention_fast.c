/* The AVX-512 copies of the CPU paged-attention kernel (see paged_attention_cpu.c for the
   semantics and the work items; docs/kernels.md for why they are built this way). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "paged_attention_cpu.h"

#if defined __AVX512F__
#include <immintrin.h>

/* libmvec's 16-lane expf (glibc's AVX-512 variant). */
__m512 _ZGVeN16v_expf(__m512);

/* The fast copies: float32, head size D of 64 or 128, G <= 8 query heads per kv head, no
   soft cap, blocks a multiple of 16 slots. The generic copy (paged_attention_cpu.c)
   computes a dot product and its horizontal sum per key and query head, and adds each
   value into an accumulator in memory: from cache it is bound by that arithmetic, not by
   the bytes.
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

#define PS_AHEAD 2
#define PS_LOC 1
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

/* Turns the fast copies off (0) or on (1) for this process: benchmarks compare the two. */
void ps_set_fast_copies(int on) { ps_fast_on = on; }

/* Whether the fast copies take this call: float32, no soft cap, 16-slot groups. */
int ps_fast_fits(int dtype, int d, int group, int block_size, float soft_cap) {
    return ps_fast_on && dtype == PS_F32 && soft_cap <= 0.0f && block_size % 16 == 0 && group <= 8 &&
           (d == 64 || d == 128);
}

/* The fast copies for a call, or 0 where they do not apply. */
int ps_pick_fast(const ps_call *c, int dtype, int d, ps_attend_fn fns[2]) {
    if (!ps_fast_fits(dtype, d, c->group, c->block_size, c->soft_cap)) return 0;
    fns[0] = ps_fast[d == 128][c->group - 1][0];
    fns[1] = ps_fast[d == 128][c->group - 1][1];
    return 1;
}
#else
void ps_set_fast_copies(int on) { (void)on; }

int ps_fast_fits(int dtype, int d, int group, int block_size, float soft_cap) {
    (void)dtype, (void)d, (void)group, (void)block_size, (void)soft_cap;
    return 0;
}

int ps_pick_fast(const ps_call *c, int dtype, int d, ps_attend_fn fns[2]) {
    (void)c, (void)dtype, (void)d, (void)fns;
    return 0;
}
#endif
