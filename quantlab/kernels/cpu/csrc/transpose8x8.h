/* An 8 x 8 float transpose in AVX registers, shared by the AVX2 and AVX-512 panel kernels (plain AVX,
 * so it inlines into either). */
#ifndef QL_TRANSPOSE8X8_H
#define QL_TRANSPOSE8X8_H

#include <immintrin.h>
#include <stdint.h>

/* 8 rows of 8 floats (row stride `stride`) transposed into out[i * out_stride + j] = in[j][i]. */
static inline __attribute__((always_inline, target("avx"))) void ql_transpose8x8(const float *in, int64_t stride,
                                                                                float *out, int64_t out_stride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(in + i * stride);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(out + i * out_stride, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
        _mm256_storeu_ps(out + (4 + i) * out_stride, _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
    }
}

#endif
