/* What the CPU paged-attention kernel's two sources share (paged_attention_cpu.c: the entry
   point and the generic copies; paged_attention_fast.c: the AVX-512 copies). */

#ifndef PAGED_ATTENTION_CPU_H
#define PAGED_ATTENTION_CPU_H

#include <stdint.h>

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

/* Scratch of one thread: scores [rows * TILE], acc [rows * d], running max, sum and
   rescale factor [rows], one widened row [d]; rows = queries x the query heads of one
   work item. */
typedef struct {
    float *scores, *acc, *max, *sum, *widened, *alpha;
    float *spare; /* [d]: where the fast path's padding rows add their zeros */
    float *partials; /* [heads * 16 * 16], 64-byte aligned: a decode group's partial dot products */
} ps_scratch;

typedef void (*ps_attend_fn)(const ps_call *, int, int, const float *, float *,
                             const int32_t *, int, int, int, int, ps_scratch *);

/* The AVX-512 copies for a call ([0] one query, [1] several), or 0 where they do not apply
   (paged_attention_fast.c; without AVX-512 they never do). */
int ps_pick_fast(const ps_call *c, int dtype, int d, ps_attend_fn fns[2]);
int ps_fast_fits(int dtype, int d, int group, int block_size, float soft_cap);

#endif
