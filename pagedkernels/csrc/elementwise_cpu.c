/* Element-wise steps of a decoder layer on the CPU, float32, each one pass over its rows.

   Between the matrix products of a layer, torch runs RMSNorm as six operators, the rotary
   embedding as six per tensor and the gated activation as two, each a dispatch and a sweep
   over memory. A decode step's rows are few, so the dispatches dominate; a prefill step's
   are many, so the sweeps do. These kernels do each step in one call and one sweep, with
   the reference's arithmetic (pagedkernels' tests compare them with the torch layers).

   Rows are spread over torch's OpenMP threads (the library shares torch's libgomp) only
   when there are enough of them to pay for waking the threads. */

#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined __x86_64__
__attribute__((simd("notinbranch"))) float expf(float);
#endif

/* Rows below which a call stays on the calling thread: a parallel region costs a few
   microseconds, as much as a decode step's whole sweep. */
#define PARALLEL_ROWS 32

/* out[r] = x[r] / rms(x[r]) * w; with residual, first residual[r] += x[r] and normalise
   that sum (the decoder's "add, then norm" between its two halves). */
void ps_rms_norm(float *x, int64_t x_stride, float *residual, int64_t res_stride,
                 const float *w, int64_t rows, int64_t dim, float eps, float *out,
                 int64_t out_stride) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * x_stride;
        if (residual) {
            float *acc = residual + r * res_stride;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) acc[i] += src[i];
            src = acc;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += src[i] * src[i];
        const float inv = 1.f / sqrtf(sum / (float)dim + eps);
        float *dst = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) dst[i] = (src[i] * inv) * w[i];
    }
}

/* In place, "rotate half" pairs (i, i + d/2): x' = x cos + rotate_half(x) sin, for every
   head of every token; cos and sin are [tokens, d] rows (both halves equal). */
void ps_rope(float *x, int64_t tokens, int64_t heads, int64_t d, int64_t tok_stride,
             int64_t head_stride, const float *cos, const float *sin, int64_t cs_stride) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (tokens >= PARALLEL_ROWS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * tok_stride + h * head_stride;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out[r] = silu(gate[r]) * up[r]; out may be gate. */
void ps_silu_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride,
                 int64_t rows, int64_t dim, float *out, int64_t out_stride) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
