/*
 * Attention of one-token queries over a quantized KV cache (quantlab/generation/kv_cache.py's 8-bit layout),
 * read as it is stored: the native decode step (decode.c) at long contexts reads a quarter of the bytes of a
 * float32 cache.
 *
 * Per key/value head, `stored` positions are 8-bit codes, then `window` positions are float32:
 *   keys, per channel in chunks of `residual` positions: key[t][i] = code * scale[c][i] + zero[c][i] (c = t / residual)
 *   values, per position in groups of `group` channels:  value[t][i] = code * scale[t][g] + zero[t][g] (g = i / group)
 * scales and zeros in float16. Nothing is dequantized into memory:
 *   q . key[t] = sum_i (q[i] scale[c][i]) code[t][i] + sum_i q[i] zero[c][i]  (q scaled once a chunk)
 *   sum_t p[t] value[t][i] = sum_t (p[t] scale[t][g]) code[t][i] + sum_t p[t] zero[t][g]
 */
#include "quantlab_cpu.h"

#ifdef QL_X86
/* 8 codes as floats. */
QL_INLINE QL_AVX2 __m256 ql_codes8(const uint8_t *codes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes)));
}

/* scores[t] = q . codes[t] + offset for t < count (rows of dim codes, dim a multiple of 8): 4 rows at a time. */
QL_AVX2 static void ql_code_dots256(const float *q, const uint8_t *codes, int64_t count, int64_t dim, float offset,
                                    float *scores) {
    int64_t t = 0;
    for (; t + 4 <= count; t += 4) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < dim; i += 8) {
            const __m256 qi = _mm256_loadu_ps(q + i);
            for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_ps(qi, ql_codes8(codes + (t + j) * dim + i), acc[j]);
        }
        for (int j = 0; j < 4; j++) scores[t + j] = ql_sum256(acc[j]) + offset;
    }
    for (; t < count; t++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), ql_codes8(codes + t * dim + i), acc);
        scores[t] = ql_sum256(acc) + offset;
    }
}

/* out[i] += sum_t p[t] value[t][i] over count positions, dim and group multiples of 32: 32 outputs at a time in
 * 4 registers, one scale and one zero converted per position and 32 outputs. */
QL_AVX2 static void ql_code_sums256(const float *p, const uint8_t *codes, const uint16_t *scales, const uint16_t *zeros,
                                    int64_t count, int64_t dim, int64_t group, float *out) {
    const int64_t groups = dim / group;
    for (int64_t i0 = 0; i0 < dim; i0 += 32) {
        const int64_t g = i0 / group;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        float zero_sum = 0.0f;
        for (int64_t t = 0; t < count; t++) {
            const float weight = p[t];
            const __m256 a = _mm256_set1_ps(weight * _cvtsh_ss(scales[t * groups + g]));
            zero_sum += weight * _cvtsh_ss(zeros[t * groups + g]);
            const uint8_t *row = codes + t * dim + i0;
            for (int j = 0; j < 4; j++) acc[j] = _mm256_fmadd_ps(a, ql_codes8(row + 8 * j), acc[j]);
        }
        const __m256 shift = _mm256_set1_ps(zero_sum);
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(out + i0 + 8 * j, _mm256_add_ps(_mm256_loadu_ps(out + i0 + 8 * j), _mm256_add_ps(acc[j], shift)));
    }
}
#endif

static void ql_code_dots(int vector, const float *q, const uint8_t *codes, int64_t count, int64_t dim, float offset,
                         float *scores) {
#ifdef QL_X86
    if (vector) {
        ql_code_dots256(q, codes, count, dim, offset, scores);
        return;
    }
#endif
    for (int64_t t = 0; t < count; t++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) sum += q[i] * (float)codes[t * dim + i];
        scores[t] = sum + offset;
    }
}

static void ql_code_sums(int vector, const float *p, const uint8_t *codes, const uint16_t *scales,
                         const uint16_t *zeros, int64_t count, int64_t dim, int64_t group, float *out) {
#ifdef QL_X86
    if (vector) {
        ql_code_sums256(p, codes, scales, zeros, count, dim, group, out);
        return;
    }
#endif
    const int64_t groups = dim / group;
    for (int64_t t = 0; t < count; t++)
        for (int64_t g = 0; g < groups; g++) {
            const float a = p[t] * ql_half_to_float(scales[t * groups + g]);
            const float b = p[t] * ql_half_to_float(zeros[t * groups + g]);
            const uint8_t *row = codes + t * dim + g * group;
            float *y = out + g * group;
            for (int64_t i = 0; i < group; i++) y[i] += a * (float)row[i] + b;
        }
}

int ql_attend_quantized(int isa, const float *q, const ql_kv_head *kv, int64_t dim, float scale, float *scores,
                        float *out) {
    if (dim < 1 || dim > QL_MAX_HEAD_DIM || kv->residual < 1 || kv->group < 1 || dim % kv->group ||
        kv->stored % kv->residual || kv->stored < 0 || kv->window < 0)
        return QL_BAD_FORMAT;
    const int vector = isa != QL_ISA_SCALAR && dim % 32 == 0 && kv->group % 32 == 0;
    float scaled_q[QL_MAX_HEAD_DIM];
    for (int64_t t0 = 0; t0 < kv->stored; t0 += kv->residual) {
        const uint16_t *chunk_scales = kv->key_scales + t0 / kv->residual * dim;
        const uint16_t *chunk_zeros = kv->key_zeros + t0 / kv->residual * dim;
        float offset = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            scaled_q[i] = q[i] * scale * ql_half_to_float(chunk_scales[i]);
            offset += q[i] * ql_half_to_float(chunk_zeros[i]);
        }
        ql_code_dots(vector, scaled_q, kv->key_codes + t0 * dim, kv->residual, dim, offset * scale, scores + t0);
    }
    ql_scores(isa, q, kv->window_keys, NULL, kv->window, dim, scale, scores + kv->stored);
    if (!ql_softmax(isa, scores, kv->stored + kv->window)) {
        memset(out, 0, (size_t)dim * sizeof(float));
        return QL_OK;
    }
    ql_weighted_sum(isa, scores + kv->stored, kv->window_values, NULL, kv->window, dim, out);
    ql_code_sums(vector, scores, kv->value_codes, kv->value_scales, kv->value_zeros, kv->stored, dim, kv->group, out);
    return QL_OK;
}
