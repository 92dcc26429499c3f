/* Small-batch dense products on the CPU: y = x W^T (+ b) for a few rows of x, the weight
   packed once into panels of 16 output features, [ceil(n / 16)][k][16].

   A decode step multiplies a handful of rows (one per request) by every weight of the
   model, so each weight streams from memory once per step with little arithmetic per
   byte. oneDNN's prepacked products (worker/gemm.py) reach their best rate from about a
   hundred rows; below that they leave the memory idle while they compute and the cores
   idle while they wait. Here each thread walks its own contiguous run of panels, one
   16-feature panel at a time: a vector of 16 weights per k, each multiplied by every
   row's x[k] (broadcast) into 16 accumulators, so every weight byte read is used by all
   rows at once, and the panel a few KiB ahead is read into L2 while this one computes.
   Rows go 16 at a time over a panel that then sits in cache.

   Built only where the compiler targets AVX-512 (-march=native on such a CPU);
   pg_available() says so, and worker/gemm.py uses oneDNN alone elsewhere. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Packs w [n][k] (rows ldw apart) into panels [ceil(n / 16)][k][16]; features past n are
   zero. */
void pg_pack(const float *w, int64_t n, int64_t k, int64_t ldw, float *panels) {
    for (int64_t j = 0; j < n; j += 16) {
        float *p = panels + j * k;
        for (int64_t kk = 0; kk < k; kk++)
            for (int t = 0; t < 16; t++) p[kk * 16 + t] = j + t < n ? w[(j + t) * ldw + kk] : 0.0f;
    }
}

#if defined __AVX512F__
#include <immintrin.h>

/* How far ahead of the weights being multiplied to read (bytes): a few hundred cycles of
   this loop, about the memory's latency. */
#define PG_AHEAD 4096

int pg_available(void) { return 1; }

/* One panel (16 features) by MR rows: xt is the rows' x transposed, [k][MR]. */
static inline __attribute__((always_inline)) void pg_tile(const float *xt, const float *panel,
                                                          int64_t k, const float *bias,
                                                          __mmask16 cols, float *y,
                                                          int64_t ldy, const int MR) {
    __m512 acc[16];
    const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(cols, bias) : _mm512_setzero_ps();
    for (int m = 0; m < MR; m++) acc[m] = b;
    for (int64_t kk = 0; kk < k; kk++) {
        __builtin_prefetch((const char *)(panel + kk * 16) + PG_AHEAD, 0, 1);
        const __m512 w = _mm512_loadu_ps(panel + kk * 16);
        for (int m = 0; m < MR; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xt[kk * MR + m]), w, acc[m]);
    }
    for (int m = 0; m < MR; m++) _mm512_mask_storeu_ps(y + m * ldy, cols, acc[m]);
}

typedef void (*pg_tile_fn)(const float *, const float *, int64_t, const float *, __mmask16,
                           float *, int64_t);
#define PG_TILE(MR)                                                                        \
    static void pg_tile_##MR(const float *xt, const float *panel, int64_t k,              \
                             const float *bias, __mmask16 cols, float *y, int64_t ldy) {  \
        pg_tile(xt, panel, k, bias, cols, y, ldy, MR);                                     \
    }
PG_TILE(1) PG_TILE(2) PG_TILE(3) PG_TILE(4) PG_TILE(5) PG_TILE(6) PG_TILE(7) PG_TILE(8)
PG_TILE(9) PG_TILE(10) PG_TILE(11) PG_TILE(12) PG_TILE(13) PG_TILE(14) PG_TILE(15) PG_TILE(16)
static const pg_tile_fn pg_tiles[17] = {
    NULL,       pg_tile_1,  pg_tile_2,  pg_tile_3,  pg_tile_4,  pg_tile_5,
    pg_tile_6,  pg_tile_7,  pg_tile_8,  pg_tile_9,  pg_tile_10, pg_tile_11,
    pg_tile_12, pg_tile_13, pg_tile_14, pg_tile_15, pg_tile_16,
};

/* y [m][n] (rows ldy apart) = x [m][k] (rows ldx apart) times the packed weight, plus
   bias [n] when not NULL. Returns 0, or -1 when scratch memory could not be had. */
int pg_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const float *panels,
              int64_t n, const float *bias, float *y, int64_t ldy) {
    const int64_t blocks = (m + 15) / 16, num_panels = (n + 15) / 16;
    /* x transposed per block of 16 rows, [blocks][k][rows of the block]: one cache line
       holds every row's x[k]. */
    float *xt = malloc(sizeof(float) * (size_t)(blocks * k * 16));
    if (xt == NULL) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t rows = m - b * 16 < 16 ? m - b * 16 : 16;
        float *dst = xt + b * k * 16;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t kk = 0; kk < k; kk++) dst[kk * rows + r] = x[(b * 16 + r) * ldx + kk];
    }
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < num_panels; j++) {
        const int64_t left = n - j * 16;
        const __mmask16 cols = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t rows = m - b * 16 < 16 ? m - b * 16 : 16;
            pg_tiles[rows](xt + b * k * 16, panels + j * k * 16, k,
                           bias != NULL ? bias + j * 16 : NULL, cols,
                           y + b * 16 * ldy + j * 16, ldy);
        }
    }
    free(xt);
    return 0;
}
#else
int pg_available(void) { return 0; }

int pg_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const float *panels,
              int64_t n, const float *bias, float *y, int64_t ldy) {
    (void)x, (void)m, (void)k, (void)ldx, (void)panels, (void)n, (void)bias, (void)y, (void)ldy;
    return -2;
}
#endif
