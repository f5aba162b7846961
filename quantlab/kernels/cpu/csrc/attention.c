/*
 * Attention of one-token queries over a KV cache: the native decode step's (decode.c, one sequence)
 * and `quantlab::attention`'s (torch_ops.cpp: the compiled decode step of a batch, grouped-query
 * heads read in place).
 *
 * For one query row q over positions t < length of its key/value head:
 *     scores[t] = q . keys[t] * scale + bias[t],  out = sum_t softmax(scores)[t] * values[t]
 * bias (an additive mask: 0 or -inf, or any float) may be NULL. Positions whose bias is -inf (or the most
 * negative float, transformers' masked value) weigh exactly 0; a row that masks every position gives
 * zeros (transformers never asks for one).
 *
 * At one token the work is a few thousand multiply-adds per head: torch's CPU attention (flash SDPA)
 * and its batched matmuls spend more on dispatch and per-head setup than on them; this operator is
 * several times faster than either on a small model's shapes (benchmarks/RESULTS.md).
 */
#include "quantlab_cpu.h"

#include <float.h>
#include <math.h>

/* A position a bias masks: -inf, or the most negative float (transformers' float masks use it). */
#define QL_MASKED(bias) ((bias) <= -FLT_MAX)

/* ---- small vector helpers ------------------------------------------------------------------- */

#ifdef QL_X86
QL_AVX512 static float ql_dot512(const float *a, const float *b, int64_t n) {
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        sum0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum0);
        sum1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), sum1);
    }
    for (; i + 16 <= n; i += 16) sum0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum0);
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

QL_AVX512 static void ql_axpy512(float *y, float a, const float *x, int64_t n) {
    __m512 scale = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(scale, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* The AVX2 versions of the helpers above, 8 lanes at a time (an AVX2-only CPU has no AVX-512). */
QL_AVX2 static float ql_dot256(const float *a, const float *b, int64_t n) {
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum0);
        sum1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), sum1);
    }
    for (; i + 8 <= n; i += 8) sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum0);
    float sum = ql_sum256(_mm256_add_ps(sum0, sum1));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

QL_AVX2 static void ql_axpy256(float *y, float a, const float *x, int64_t n) {
    const __m256 scale = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}
#endif

static float ql_dot(int isa, const float *a, const float *b, int64_t n) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX512) return ql_dot512(a, b, n);
    if (isa == QL_ISA_AVX2) return ql_dot256(a, b, n);
#endif
    float partial[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) partial[j] += a[i + j] * b[i + j];
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += partial[j];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static void ql_axpy(int isa, float *y, float a, const float *x, int64_t n) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX512) {
        ql_axpy512(y, a, x, n);
        return;
    }
    if (isa == QL_ISA_AVX2) {
        ql_axpy256(y, a, x, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* ---- one query row ------------------------------------------------------------------------------ */

#ifdef QL_X86

/* scores[t] = q . keys[t] * scale (+ bias[t]) for t < length, head_dim a multiple of 16: 4 positions at a
 * time (4 dot products summed together), faster than the scalar version in the native decode step
 * (benchmarks/RESULTS.md). */
QL_AVX512 static void ql_scores512(const float *q, const float *keys, const float *bias, int64_t length, int64_t dim,
                                   float scale, float *scores) {
    int64_t t = 0;
    for (; t + 4 <= length; t += 4) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t i = 0; i < dim; i += 16) {
            const __m512 qi = _mm512_loadu_ps(q + i);
            for (int j = 0; j < 4; j++) acc[j] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(keys + (t + j) * dim + i), acc[j]);
        }
        ql_store_sums(4, acc, scores + t);
        __m128 scaled = _mm_mul_ps(_mm_loadu_ps(scores + t), _mm_set1_ps(scale));
        if (bias) scaled = _mm_add_ps(scaled, _mm_loadu_ps(bias + t));
        _mm_storeu_ps(scores + t, scaled);
    }
    for (; t < length; t++) scores[t] = ql_dot512(q, keys + t * dim, dim) * scale + (bias ? bias[t] : 0.0f);
}

/* scores[t] = exp(scores[t] - top) for t < length, 16 at a time; returns their sum. */
QL_AVX512 static float ql_exps512(float *scores, int64_t length, float top) {
    const __m512 max = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 16) {
        const __mmask16 mask = length - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (length - t)) - 1u);
        const __m512 e = ql_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + t), max));
        _mm512_mask_storeu_ps(scores + t, mask, e);
        total = _mm512_mask_add_ps(total, mask, total, e);
    }
    return _mm512_reduce_add_ps(total);
}

/* ql_scores512 on 8 lanes (head_dim a multiple of 8). */
QL_AVX2 static void ql_scores256(const float *q, const float *keys, const float *bias, int64_t length, int64_t dim,
                                 float scale, float *scores) {
    int64_t t = 0;
    for (; t + 4 <= length; t += 4) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < dim; i += 8) {
            const __m256 qi = _mm256_loadu_ps(q + i);
            for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(keys + (t + j) * dim + i), acc[j]);
        }
        for (int j = 0; j < 4; j++) scores[t + j] = ql_sum256(acc[j]) * scale + (bias ? bias[t + j] : 0.0f);
    }
    for (; t < length; t++) scores[t] = ql_dot256(q, keys + t * dim, dim) * scale + (bias ? bias[t] : 0.0f);
}

/* out[i] = sum over t < length of weights[t] * values[t][i] (value rows of dim floats), dim a multiple of 8,
 * positions the bias masks skipped: 32 outputs at a time in 4 registers (8 at a time when dim is not a
 * multiple of 32), so out is written once, not once a position (faster than an axpy into memory per
 * position; benchmarks/RESULTS.md). */
QL_AVX2 static void ql_weighted_sum256(const float *weights, const float *values, const float *bias, int64_t length,
                                       int64_t dim, float *out) {
    const int64_t step = dim % 32 == 0 ? 32 : 8;
    for (int64_t i0 = 0; i0 < dim; i0 += step) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t t = 0; t < length; t++) {
            if (bias && QL_MASKED(bias[t])) continue;
            const __m256 w = _mm256_set1_ps(weights[t]);
            const float *row = values + t * dim + i0;
            if (step == 32)
                for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * j), acc[j]);
            else
                acc[0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row), acc[0]);
        }
        for (int64_t j = 0; j < step / 8; j++) _mm256_storeu_ps(out + i0 + 8 * j, acc[j]);
    }
}

/* ql_exps512 on 8 lanes, the tail by expf. */
QL_AVX2 static float ql_exps256(float *scores, int64_t length, float top) {
    const __m256 max = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= length; t += 8) {
        const __m256 e = ql_exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t), max));
        _mm256_storeu_ps(scores + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = ql_sum256(sum);
    for (; t < length; t++) total += scores[t] = expf(scores[t] - top);
    return total;
}
#endif

/* scores[t] = q . keys[t] * scale (+ bias[t]) for t < length (keys: rows of dim floats). */
void ql_scores(int isa, const float *q, const float *keys, const float *bias, int64_t length, int64_t dim, float scale,
               float *scores) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX512 && dim % 16 == 0) {
        ql_scores512(q, keys, bias, length, dim, scale, scores);
        return;
    }
    if (isa == QL_ISA_AVX2 && dim % 8 == 0) {
        ql_scores256(q, keys, bias, length, dim, scale, scores);
        return;
    }
#endif
    for (int64_t t = 0; t < length; t++) scores[t] = ql_dot(isa, q, keys + t * dim, dim) * scale + (bias ? bias[t] : 0.0f);
}

/* scores = softmax(scores) over t < length, in place; returns 0 (scores untouched) when every score is -inf. */
int ql_softmax(int isa, float *scores, int64_t length) {
    float top = -INFINITY;
    for (int64_t t = 0; t < length; t++) top = scores[t] > top ? scores[t] : top;
    if (top == -INFINITY) return 0;
    float total;
#ifdef QL_X86
    if (isa == QL_ISA_AVX512)
        total = ql_exps512(scores, length, top);
    else if (isa == QL_ISA_AVX2)
        total = ql_exps256(scores, length, top);
    else
#endif
    {
        total = 0.0f;
        for (int64_t t = 0; t < length; t++) total += scores[t] = expf(scores[t] - top);
    }
    const float inverse = 1.0f / total;
    for (int64_t t = 0; t < length; t++) scores[t] *= inverse;
    return 1;
}

/* out[i] = sum over t < length of weights[t] * values[t][i] (value rows of dim floats), positions the bias
 * masks skipped (out is overwritten). */
void ql_weighted_sum(int isa, const float *weights, const float *values, const float *bias, int64_t length, int64_t dim,
                     float *out) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX2 && dim % 8 == 0) {
        ql_weighted_sum256(weights, values, bias, length, dim, out);
        return;
    }
#endif
    memset(out, 0, (size_t)dim * sizeof(float));
    for (int64_t t = 0; t < length; t++) {
        /* the vector exp floors its input at -87.3 (e^-87.3 ~ 1e-38, below the total's last bit): a masked
         * position is skipped here, so it weighs exactly 0 */
        if (bias && QL_MASKED(bias[t])) continue;
        ql_axpy(isa, out, weights[t], values + t * dim, dim);
    }
}

/* out[dim] = one query row's attention over `length` positions (keys and values: rows of dim floats),
 * scores: scratch for `length` floats. */
void ql_attend(int isa, const float *q, const float *keys, const float *values, const float *bias, int64_t length,
               int64_t dim, float scale, float *scores, float *out) {
    ql_scores(isa, q, keys, bias, length, dim, scale, scores);
    if (!ql_softmax(isa, scores, length)) { /* nothing to attend to (or no positions): zeros */
        memset(out, 0, (size_t)dim * sizeof(float));
        return;
    }
    ql_weighted_sum(isa, scores, values, bias, length, dim, out);
}

/* ---- a batch of one-token queries ----------------------------------------------------------------- */

typedef struct {
    const float *q, *keys, *values, *bias;
    int64_t kv_heads, groups, length, dim;
    float scale;
    int isa;
    float *scores; /* [batch * kv_heads, length] */
    float *out;
} ql_attention_job;

/* Chunk b * kv_heads + h: the `groups` query rows of sequence b's key/value head h, one after the other
 * over the same keys and values (in L1 after the first). Positions past the last one the mask leaves
 * (a static cache's unused tail) are not read. */
static void ql_attention_chunk(void *arg, int64_t chunk) {
    const ql_attention_job *job = (const ql_attention_job *)arg;
    const int64_t b = chunk / job->kv_heads, dim = job->dim, length = job->length;
    const float *bias = job->bias ? job->bias + b * length : NULL;
    int64_t used = length;
    if (bias)
        while (used > 0 && QL_MASKED(bias[used - 1])) used--;
    const float *keys = job->keys + chunk * length * dim, *values = job->values + chunk * length * dim;
    for (int64_t g = 0; g < job->groups; g++) {
        const int64_t row = chunk * job->groups + g;
        ql_attend(job->isa, job->q + row * dim, keys, values, bias, used, dim, job->scale, job->scores + chunk * length,
                  job->out + row * dim);
    }
}

/* out = attention of one-token queries, every tensor contiguous: q and out [batch, kv_heads, groups, dim]
 * float32 (query head h * groups + g of a grouped-query layer is row g of key/value head h), keys and
 * values [batch, kv_heads, length, dim] float32, and a mask of one row per sequence, [batch, length]:
 * `bias` (float, added to the scores) or `allowed` (bool bytes, nonzero attends), or neither. */
QL_API int ql_attention(const float *q, const float *keys, const float *values, const float *bias,
                        const uint8_t *allowed, int64_t batch, int64_t kv_heads, int64_t groups, int64_t length,
                        int64_t dim, float scale, float *out, int threads) {
    if (batch < 0 || kv_heads < 1 || groups < 1 || length < 0 || dim < 1 || (bias && allowed)) return QL_BAD_FORMAT;
    const int64_t rows = batch * kv_heads * (length ? length : 1);
    float *scores = malloc((size_t)(rows + (allowed ? batch * length : 0)) * sizeof(float));
    if (!scores) return QL_NO_MEMORY;
    if (allowed) { /* a bool mask as its bias, 0 or -inf, once per sequence (after the scores) */
        float *own = scores + rows;
        for (int64_t i = 0; i < batch * length; i++) own[i] = allowed[i] ? 0.0f : -INFINITY;
        bias = own;
    }
    ql_attention_job job = {q, keys, values, bias, kv_heads, groups, length, dim, scale, ql_isa(), scores, out};
    const int64_t work = batch * kv_heads * groups * length * dim;
    ql_run(ql_attention_chunk, &job, batch * kv_heads, work >= 32768 ? threads : 1);
    free(scores);
    return QL_OK;
}
