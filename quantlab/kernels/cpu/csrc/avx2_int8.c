/* The int8-activation kernel for AVX2 (the scheme: int8_activations.c), as llama.cpp multiplies Q4_0
 * and Q8_0 by Q8_0 on AVX2: vpmaddubsw multiplies 32 unsigned bytes by 32 signed ones into 16 int16
 * sums of pairs and vpmaddwd adds those pairs into 8 int32. Neither sum can saturate: 4-bit codes
 * (0..15) times |xq| <= 127 gives pairs of at most 3810, and the low and high nibbles' pairs added
 * at most 7620; int8 codes go in as |q| (unsigned, -128 -> 128) times xq with q's sign, pairs of at
 * most 2 * 128 * 127 = 32512. So each block's integer dot product is q . xq exactly. */
#include "quantlab_cpu.h"

#ifdef QL_X86
#define QL_BY_FEATURE_BYTES_256 512 /* 4-bit rows this long are read feature by feature (ql_feature256_a8) */

/* 16 floats as 16 int8 (round to nearest even, as torch.round), returning their int32 sum's lanes. */
QL_INLINE QL_AVX2 __m256i ql_round16_a8(__m256 first, __m256 second, __m256 inverse, int8_t *out) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(first, inverse));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(second, inverse));
    /* packs works within 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7] -> [a0-7 | b0-7] */
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
    _mm_storeu_si128((__m128i *)out, _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
    return _mm256_add_epi32(a, b);
}

/* x, as prepared for the weight, into int8 blocks of 64 inputs, one scale and one sum of the int8
 * values per block: the values of ql_quantize_x_a8 (avx512_vnni.c), one block after the other. In the
 * nibble layout a block goes as [the 32 inputs meeting its code bytes' low nibbles (evens of chunk 0,
 * evens of chunk 1), the 32 meeting the high nibbles (odds of chunk 0, odds of chunk 1)]; in the byte
 * layout x keeps its order. */
QL_AVX2 void ql_quantize_x_a8_256(const float *xp, int64_t m, int64_t row_length, int nibble, int8_t *xq, float *xd,
                                  int32_t *xs) {
    const int64_t blocks = row_length / 64;
    const int order[4] = {0, nibble ? 32 : 16, nibble ? 16 : 32, 48}; /* where each 16 of the output come from */
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < m * blocks; b++) {
        const float *src = xp + b * 64;
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 64; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(src + i), magnitude));
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        const float a = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
        const __m256 inverse = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
        __m256i sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++)
            sum = _mm256_add_epi32(sum, ql_round16_a8(_mm256_loadu_ps(src + order[i]), _mm256_loadu_ps(src + order[i] + 8),
                                                      inverse, xq + b * 64 + 16 * i));
        __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0x4e));
        total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0xb1));
        xd[b] = a / 127.0f;
        xs[b] = _mm_cvtsi128_si32(total);
    }
}

/* One block of 4-bit codes (32 bytes: low nibbles meet `lows`, the first 32 int8 inputs, high nibbles
 * `highs`) as 8 float partial sums of its exact integer dot product. */
QL_INLINE QL_AVX2 __m256 ql_block_dot256(__m256i packed, __m256i lows, __m256i highs) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(packed, low), lows),
                                           _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low), highs));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* 4 features from n, one row, 4-bit codes: acc_j += scale * d * float(q . xq) per block, then the
 * zero point's share, sum over groups of scale * zero * xz[g] (ql_zero_terms), taken off. A block's
 * 32 code bytes are one load: low nibbles meet its first 32 int8 inputs, high nibbles the next 32.
 * The next 4 features' codes are prefetched as they go (ql_prefetch_next4, avx2.c): more tokens/s in
 * the native step, on one and two threads (benchmarks/RESULTS.md). For rows shorter than
 * QL_BY_FEATURE_BYTES_256, whose 4 rows lie in one short run of memory anyway. */
QL_INLINE QL_AVX2 void ql_block256_a8(const ql_weight *w, const int8_t *xq, const float *xd, const float *xz,
                                      int64_t n, float *y, const float *params) {
    enum { NR = 4 };
    const int64_t G = w->groups, per_group = w->group_codes / 64, blocks = G * per_group;
    const int64_t row_bytes = G * w->group_bytes;
    __m256 acc[4];
    for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0, g = 0, in_group = 0; b < blocks; b++, in_group++) {
        if (in_group == per_group) { /* the group of block b, counted: a division here showed in profiles */
            in_group = 0;
            g++;
        }
        const __m256i lows = _mm256_loadu_si256((const __m256i *)(xq + b * 64));
        const __m256i highs = _mm256_loadu_si256((const __m256i *)(xq + b * 64 + 32));
        const __m256 d = _mm256_set1_ps(xd[b]);
        if ((b & 1) == 0) /* one 64-byte line holds two blocks of one feature: ql_prefetch_next4's reason */
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(w->codes + (n + j + 4) * row_bytes + b * 32), _MM_HINT_T0);
        for (int j = 0; j < NR; j++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(w->codes + (n + j) * row_bytes + b * 32));
            const __m256 dot = ql_block_dot256(packed, lows, highs);
            acc[j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(_mm256_broadcast_ss(params + j * G + g), d), acc[j]);
        }
    }
    for (int j = 0; j < NR; j++) {
        const float *scale = params + j * G, *zero = params + (NR + j) * G;
        float share = 0.0f;
        for (int64_t g = 0; g < G; g++) share += scale[g] * zero[g] * xz[g];
        y[n + j] = ql_sum256(acc[j]) - share;
    }
}

/* One feature, one row, 4-bit codes, its codes read start to end (rows of QL_BY_FEATURE_BYTES_256 or more,
 * and the last features short of 4): 4 features interleaved block by block streamed long rows from DRAM
 * at about three quarters of the speed (benchmarks/RESULTS.md). Two chains: FMA latency. */
QL_INLINE QL_AVX2 void ql_feature256_a8(const ql_weight *w, const int8_t *xq, const float *xd, const float *xz,
                                        int64_t n, float *y, const float *scale, const float *zero) {
    const int64_t G = w->groups, per_group = w->group_codes / 64;
    const int64_t row_bytes = G * w->group_bytes;
    const uint8_t *codes = w->codes + n * row_bytes;
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    float share = 0.0f;
    for (int64_t g = 0, b = 0; g < G; g++) {
        share += scale[g] * zero[g] * xz[g];
        for (int64_t i = 0; i < per_group; i++, b++) {
            if ((b & 1) == 0) /* the same line 4 features on, as ql_block256_a8 asks for */
                _mm_prefetch((const char *)(codes + 4 * row_bytes + b * 32), _MM_HINT_T0);
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(codes + b * 32));
            const __m256i lows = _mm256_loadu_si256((const __m256i *)(xq + b * 64));
            const __m256i highs = _mm256_loadu_si256((const __m256i *)(xq + b * 64 + 32));
            const __m256 dot = ql_block_dot256(packed, lows, highs);
            const __m256 sd = _mm256_set1_ps(scale[g] * xd[b]);
            if (b & 1)
                odd = _mm256_fmadd_ps(dot, sd, odd);
            else
                even = _mm256_fmadd_ps(dot, sd, even);
        }
    }
    y[n] = ql_sum256(_mm256_add_ps(even, odd)) - share;
}

/* One feature, one row, int8 codes: scale * d * float(q . xq) per block. Each feature's codes are
 * read start to end, as avx512_vnni.c does (a contiguous run streams from DRAM faster). */
QL_INLINE QL_AVX2 void ql_feature256_a8_int8(const ql_weight *w, const int8_t *xq, const float *xd, int64_t n,
                                             float *y, const float *scale) {
    const int64_t G = w->groups, per_group = w->group_codes / 64;
    const uint8_t *codes = w->codes + n * G * w->group_bytes;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps(); /* two chains: FMA latency */
    for (int64_t g = 0, b = 0; g < G; g++) {
        for (int64_t i = 0; i < per_group; i++, b++) {
            __m256i dot = _mm256_setzero_si256();
            for (int half = 0; half < 64; half += 32) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(codes + b * 64 + half));
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * 64 + half));
                const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
                dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
            }
            const __m256 sd = _mm256_set1_ps(scale[g] * xd[b]);
            if (b & 1)
                odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sd, odd);
            else
                even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sd, even);
        }
    }
    y[n] = ql_sum256(_mm256_add_ps(even, odd));
}

/* y[r, n] for features [n0, n1) of a weight `ql_a8_eligible` accepts, x as ql_quantize_x_a8_256 left
 * it: features in blocks of 4 (4-bit) or one by one (int8), every row for each; params: scratch for
 * 4 features' scales and zeros, xz: for m x groups floats. */
QL_AVX2 void ql_gemm256_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m,
                           int64_t row_length, int64_t n0, int64_t n1, float *y, int64_t y_stride, float *params,
                           float *xz) {
    const int64_t G = w->groups, blocks = row_length / 64;
    if (w->kind == QL_INT8) {
        for (int64_t n = n0; n < n1; n++) {
            ql_params256(w, n, 1, params, params + G);
            for (int64_t r = 0; r < m; r++)
                ql_feature256_a8_int8(w, xq + r * blocks * 64, xd + r * blocks, n, y + r * y_stride, params);
        }
        return;
    }
    for (int64_t r = 0; r < m; r++) ql_zero_terms(w, xd + r * blocks, xs + r * blocks, xz + r * G);
    const int by_feature = G * w->group_bytes >= QL_BY_FEATURE_BYTES_256;
    for (int64_t n = n0; n < n1;) {
        const int NR = n1 - n >= 4 && !by_feature ? 4 : 1;
        ql_params256(w, n, NR, params, params + NR * G);
        for (int64_t r = 0; r < m; r++) {
            const int8_t *xr = xq + r * blocks * 64;
            if (NR == 4)
                ql_block256_a8(w, xr, xd + r * blocks, xz + r * G, n, y + r * y_stride, params);
            else
                ql_feature256_a8(w, xr, xd + r * blocks, xz + r * G, n, y + r * y_stride, params, params + G);
        }
        n += NR;
    }
}
#endif
