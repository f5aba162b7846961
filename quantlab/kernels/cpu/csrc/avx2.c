/* The AVX2 kernels (AVX2 + FMA): one generic decoder, 8 weights a step. */
#include "quantlab_cpu.h"

#ifdef QL_X86
/* ---- AVX2 ------------------------------------------------------------------------------------ */

typedef struct {
    __m256i shuffle;
    __m256i shift;
    __m256i mask;
} ql_bits256;

static QL_AVX2 ql_bits256 ql_bits256_make(int bits) {
    uint8_t shuffle[32];
    int32_t shift[8];
    for (int j = 0; j < 8; j++) {
        int bit = j * bits, byte = bit >> 3, at = (j / 4) * 16 + (j % 4) * 4;
        shuffle[at] = (uint8_t)byte;
        shuffle[at + 1] = (uint8_t)(byte + 1);
        shuffle[at + 2] = shuffle[at + 3] = 0x80;
        shift[j] = bit & 7;
    }
    ql_bits256 constants;
    constants.shuffle = _mm256_loadu_si256((const __m256i *)shuffle);
    constants.shift = _mm256_loadu_si256((const __m256i *)shift);
    constants.mask = _mm256_set1_epi32((1 << bits) - 1);
    return constants;
}

typedef struct {
    __m256 low, high; /* NF4: levels 0-7 and 8-15, times absmax */
    __m256 zero, scale;
} ql_group256;

QL_INLINE QL_AVX2 ql_group256 ql_group256_make(const ql_weight *w, float scale, float zero) {
    ql_group256 out;
    out.zero = _mm256_set1_ps(zero);
    out.scale = _mm256_set1_ps(scale);
    if (w->kind == QL_NF4) {
        out.low = _mm256_mul_ps(_mm256_loadu_ps(w->levels), out.scale);
        out.high = _mm256_mul_ps(_mm256_loadu_ps(w->levels + 8), out.scale);
    } else {
        out.low = out.high = out.scale;
    }
    return out;
}

/* Codes [c, c + 8) of a group (`bits` bytes) as 8 floats. */
QL_INLINE QL_AVX2 __m256 ql_values8(const ql_weight *w, const ql_bits256 *bits, const uint8_t *group, int64_t c,
                                    const ql_group256 *constants) {
    const uint8_t *src = group + c * w->bits / 8;
    int64_t left = w->group_bytes - c * w->bits / 8;
    __m128i bytes;
    if (left >= 8) {
        bytes = _mm_loadl_epi64((const __m128i *)src);
    } else {
        uint8_t tail[8] = {0};
        memcpy(tail, src, (size_t)left);
        bytes = _mm_loadl_epi64((const __m128i *)tail);
    }
    __m256i codes = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(bytes), bits->shuffle);
    codes = _mm256_and_si256(_mm256_srlv_epi32(codes, bits->shift), bits->mask);
    if (w->kind == QL_NF4) {
        __m256 low = _mm256_permutevar8x32_ps(constants->low, codes);
        __m256 high = _mm256_permutevar8x32_ps(constants->high, codes);
        return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
    }
    if (w->kind == QL_INT8) codes = _mm256_srai_epi32(_mm256_slli_epi32(codes, 24), 24);
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(codes), constants->zero), constants->scale);
}

QL_INLINE QL_AVX2 float ql_sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

QL_INLINE QL_AVX2 void ql_block256(const int NR, const int R, const ql_weight *w, const ql_bits256 *bits,
                                   const ql_layout *layout, const float *xp, int64_t row_length, int64_t n0, float *y,
                                   int64_t y_stride, float *params) {
    const int64_t G = w->groups;
    for (int j = 0; j < NR; j++) ql_params_scalar(w, n0 + j, params + 2 * j * G, params + (2 * j + 1) * G);
    __m256 acc[4][4];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w->groups; g++) {
        const uint8_t *group[4];
        ql_group256 constants[4];
        for (int j = 0; j < NR; j++) {
            int64_t index = (n0 + j) * w->groups + g;
            group[j] = w->codes + index * w->group_bytes;
            constants[j] = ql_group256_make(w, params[2 * j * G + g], params[(2 * j + 1) * G + g]);
        }
        const float *xg = xp + g * layout->padded_group;
        for (int64_t c = 0; c < w->group_codes; c += 8) {
            __m256 value[4];
            for (int j = 0; j < NR; j++) value[j] = ql_values8(w, bits, group[j], c, &constants[j]);
            for (int r = 0; r < R; r++) {
                __m256 xv = _mm256_loadu_ps(xg + r * row_length + c);
                for (int j = 0; j < NR; j++) acc[j][r] = _mm256_fmadd_ps(value[j], xv, acc[j][r]);
            }
        }
    }
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) y[r * y_stride + n0 + j] = ql_sum256(acc[j][r]);
}

QL_AVX2 void ql_gemm256(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t m, int64_t n0,
                               int64_t n1, float *y, int64_t y_stride, float *params) {
    ql_bits256 bits = ql_bits256_make(w->bits);
    int64_t row_length = w->groups * layout->padded_group;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        for (int64_t r = 0; r < m;) {
            const float *xr = xp + r * row_length;
            float *yr = y + r * y_stride;
            if (m - r >= 4) {
                for (int j = 0; j < 4; j++) ql_block256(1, 4, w, &bits, layout, xr, row_length, n + j, yr, y_stride, params);
                r += 4;
            } else if (m - r >= 2) {
                ql_block256(2, 2, w, &bits, layout, xr, row_length, n, yr, y_stride, params);
                ql_block256(2, 2, w, &bits, layout, xr, row_length, n + 2, yr, y_stride, params);
                r += 2;
            } else {
                ql_block256(4, 1, w, &bits, layout, xr, row_length, n, yr, y_stride, params);
                r += 1;
            }
        }
    }
    for (; n < n1; n++)
        for (int64_t r = 0; r < m; r++)
            ql_block256(1, 1, w, &bits, layout, xp + r * row_length, row_length, n, y + r * y_stride, y_stride, params);
}

QL_AVX2 void ql_dequantize256(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride,
                                     float *params) {
    ql_bits256 bits = ql_bits256_make(w->bits);
    for (int64_t n = n0; n < n1; n++) {
        float *row = out + (n - n0) * out_stride;
        ql_params_scalar(w, n, params, params + w->groups);
        for (int64_t g = 0; g < w->groups; g++) {
            int64_t index = n * w->groups + g, first = g * w->group_size;
            int64_t valid = w->group_size < w->k - first ? w->group_size : w->k - first;
            const uint8_t *group = w->codes + index * w->group_bytes;
            ql_group256 constants = ql_group256_make(w, params[g], params[w->groups + g]);
            for (int64_t c = 0; c < valid; c += 8) {
                __m256 value = ql_values8(w, &bits, group, c, &constants);
                if (valid - c >= 8) {
                    _mm256_storeu_ps(row + first + c, value);
                } else {
                    float tail[8];
                    _mm256_storeu_ps(tail, value);
                    memcpy(row + first + c, tail, (size_t)(valid - c) * sizeof(float));
                }
            }
        }
    }
}
#endif
