/* The int8-activation kernel for AVX512-VNNI (the scheme: int8_activations.c): vpdpbusd multiplies
 * unsigned codes by signed x (int8 codes are signed: they go in offset to unsigned, q ^ 0x80, and the
 * offset's share, 128 * sum xq, is taken off in int32, so each block's integer dot product is q . xq
 * exactly).
 * The codes are also prefetched a few blocks ahead: at this speed a call streams its weights faster
 * than the hardware prefetcher ramps up on each 4 KiB page. */
#include "quantlab_cpu.h"

#ifdef QL_X86
#define QL_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))
#define QL_PREFETCH_BLOCKS 4 /* blocks of 4 features ahead into L1 (the best of the distances measured) */
/* 4-bit codes also go to L2 twice as far ahead, a small gain in the decode step; the int8 kernel, which
 * reads each feature start to end, gained nothing from it, so it does without (benchmarks/RESULTS.md). */
#define QL_PREFETCH_L2_BLOCKS 8
#define QL_BY_FEATURE_BYTES 512 /* rows this long are read feature by feature (ql_block_a8_short_by_feature) */
#define QL_PAIR_WINDOW 16 /* pairs of blocks of one feature read in order before the next feature's: 2 KiB of inputs */

static inline void ql_prefetch(const uint8_t *from, int64_t bytes, const uint8_t *end) {
    for (int64_t b = 0; b < bytes && from + b < end; b += 64) _mm_prefetch((const char *)(from + b), _MM_HINT_T0);
}

static inline void ql_prefetch_l2(const uint8_t *from, int64_t bytes, const uint8_t *end) {
    for (int64_t b = 0; b < bytes && from + b < end; b += 64) _mm_prefetch((const char *)(from + b), _MM_HINT_T1);
}

/* x, as prepared for the weight, into int8 blocks of 64 inputs, one scale and one sum of the int8
 * values per block. In the nibble layout (`nibble`: groups padded to whole chunks of 32, each chunk its
 * 16 even inputs, then its 16 odd ones) a block's inputs split into those meeting its 32 code bytes'
 * low nibbles [evens of chunk 0, evens of chunk 1] and high nibbles [odds of chunk 0, odds of chunk 1],
 * and blocks go in pairs: [lows of b, lows of b + 1, highs of b, highs of b + 1] (an odd last block:
 * [lows, highs]), as ql_block_a8 reads two blocks' codes at once; in the byte layout x keeps its
 * order, one input per code byte. The order changes neither scale nor sum. */
QL_VNNI void ql_quantize_x_a8(const float *xp, int64_t m, int64_t row_length, int nibble, int8_t *xq, float *xd,
                              int32_t *xs) {
    const int64_t blocks = row_length / 64;
    const int second = nibble ? 32 : 16, third = nibble ? 16 : 32;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            const float *src = xp + r * row_length + b * 64;
            __m512 v[4] = {_mm512_loadu_ps(src), _mm512_loadu_ps(src + second), _mm512_loadu_ps(src + third),
                           _mm512_loadu_ps(src + 48)};
            __m512 amax = _mm512_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])),
                                        _mm512_max_ps(_mm512_abs_ps(v[2]), _mm512_abs_ps(v[3])));
            float a = _mm512_reduce_max_ps(amax);
            __m512 inverse = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
            int8_t *out[4];
            if (nibble) { /* pairs of blocks: [lows of b, lows of b + 1, highs of b, highs of b + 1] */
                const int lone = b == blocks - 1 && blocks % 2;
                int8_t *pair = xq + r * blocks * 64 + (b / 2) * 128;
                out[0] = pair + (lone ? 0 : (b % 2) * 32);
                out[2] = lone ? out[0] + 32 : pair + 64 + (b % 2) * 32;
                out[1] = out[0] + 16;
                out[3] = out[2] + 16;
            } else {
                for (int i = 0; i < 4; i++) out[i] = xq + (r * blocks + b) * 64 + 16 * i;
            }
            __m512i sum = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse)); /* round to nearest even */
                sum = _mm512_add_epi32(sum, q);
                _mm_storeu_si128((__m128i *)out[i], _mm512_cvtsepi32_epi8(q));
            }
            xd[r * blocks + b] = a / 127.0f;
            xs[r * blocks + b] = _mm512_reduce_add_epi32(sum);
        }
    }
}

/* One pair of blocks of one feature as floats, lanes 0-7 block b's and 8-15 block b + 1's: its 64 code
 * bytes (the pair's low nibbles meet x's lows, the high nibbles x's highs) times x's pair [lows, highs]. */
QL_INLINE QL_VNNI __m512 ql_pair_dot(const uint8_t *codes, const int8_t *x, __m512i low) {
    const __m512i packed = _mm512_loadu_si512(codes);
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(packed, low), _mm512_loadu_si512(x));
    dot = _mm512_dpbusd_epi32(dot, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low), _mm512_loadu_si512(x + 64));
    return _mm512_cvtepi32_ps(dot);
}

/* The odd last block of a feature as floats: its 32 code bytes times x's [lows, highs] of that block. */
QL_INLINE QL_VNNI __m512 ql_lone_dot(const uint8_t *codes, const int8_t *x, __m512i low) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)codes), low256 = _mm512_castsi512_si256(low);
    const __m256i lo = _mm256_and_si256(packed, low256), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low256);
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(x)));
}

/* NR features from n, one row, 4-bit codes: acc_j += scale * d * float(q . xq) per block, and the zero
 * point's share, sum over groups of scale * zero * xz[g] (xz[g] = sum of d * sum xq over the group's
 * blocks, once per call: ql_zero_terms), taken off at the end. Two blocks a step: one 64-byte load
 * holds both blocks' 128 codes, its low nibbles meet the pair's low-nibble inputs and its high nibbles
 * theirs (ql_quantize_x_a8 lays x out in such pairs), so lanes 0-7 of the dot product are block b's
 * and lanes 8-15 block b + 1's: half the instructions of a block at a time. An odd last block goes
 * alone. The inner step is vector work only: the pair's two scales broadcast from memory times the
 * pair's d. Each feature's codes are read start to end before the next one's, as they lie: 4 features
 * interleaved block by block streamed rows of 768 bytes from DRAM at about half the speed (one cold
 * product of 1,536 inputs: 14 against 28.6 GB/s, benchmarks/RESULTS.md); these rows are longer. */
QL_INLINE QL_VNNI void ql_block_a8(const int NR, const ql_weight *w, const int8_t *xq, const float *xd,
                                   const float *xz, int64_t n, float *y, const float *params) {
    const int64_t G = w->groups, per_group = w->group_codes / 64, blocks = G * per_group;
    const int64_t row_bytes = G * w->group_bytes;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[4];
    for (int j = 0; j < NR; j++) { /* each feature's codes in order, as they lie (ql_block_a8_short_by_feature) */
        const uint8_t *row = w->codes + (n + j) * row_bytes;
        const float *scale = params + j * G;
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(); /* two chains: FMA latency */
        int64_t b = 0;
        for (; b + 2 <= blocks; b += 2) {
            const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(xd[b]), _mm256_set1_ps(xd[b + 1]), 1);
            const __m512 sd = _mm512_insertf32x8(_mm512_set1_ps(scale[b / per_group]),
                                                 _mm256_set1_ps(scale[(b + 1) / per_group]), 1);
            const __m512 dot = ql_pair_dot(row + b * 32, xq + b * 64, low);
            if (b & 2)
                odd = _mm512_fmadd_ps(dot, _mm512_mul_ps(sd, d), odd);
            else
                even = _mm512_fmadd_ps(dot, _mm512_mul_ps(sd, d), even);
        }
        if (b < blocks) /* the odd last block: [its lows, its highs] */
            odd = _mm512_fmadd_ps(ql_lone_dot(row + b * 32, xq + b * 64, low),
                                  _mm512_set1_ps(scale[b / per_group] * xd[b]), odd);
        acc[j] = _mm512_add_ps(even, odd);
    }
    for (int j = 0; j < NR; j++) { /* the zero point's share, lane by lane */
        const float *scale = params + j * G, *zero = params + (4 + j) * G;
        for (int64_t g = 0; g < G; g += 16) {
            const __mmask16 mask = G - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - g)) - 1u);
            const __m512 sz = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, scale + g), _mm512_maskz_loadu_ps(mask, zero + g));
            acc[j] = _mm512_fnmadd_ps(sz, _mm512_maskz_loadu_ps(mask, xz + g), acc[j]);
        }
    }
    ql_store_sums(NR, acc, y + n);
}

/* The short kernels' start for 4 features of at most 32 groups: each feature's scales in two registers,
 * converted once (a pair's two scales are then picked out of them by one permute instead of going through
 * memory: ql_params4_512), and acc starting from minus the zero point's share. */
QL_INLINE QL_VNNI void ql_short_start(const ql_weight *w, const float *xz, int64_t n, __m512 *scale_low,
                                      __m512 *scale_high, __m512 *acc) {
    const int64_t G = w->groups, low_count = G < 16 ? G : 16, high_count = G - low_count;
    const __m512 xz_low = ql_load16(xz, QL_F32, 0, low_count);
    const __m512 xz_high = high_count ? ql_load16(xz, QL_F32, 16, high_count) : _mm512_setzero_ps();
    for (int j = 0; j < 4; j++) {
        const int64_t first = (n + j) * G;
        scale_low[j] = ql_load16(w->scale, w->scale_dtype, first, low_count);
        scale_high[j] = high_count ? ql_load16(w->scale, w->scale_dtype, first + 16, high_count) : _mm512_setzero_ps();
        const __m512 zero_low = w->zero ? ql_load16(w->zero, w->zero_dtype, first, low_count) : _mm512_set1_ps(w->zero_const);
        const __m512 zero_high = !high_count ? _mm512_setzero_ps()
                                 : w->zero   ? ql_load16(w->zero, w->zero_dtype, first + 16, high_count)
                                             : _mm512_set1_ps(w->zero_const);
        acc[j] = _mm512_fnmadd_ps(_mm512_mul_ps(scale_low[j], zero_low), xz_low, _mm512_setzero_ps());
        acc[j] = _mm512_fnmadd_ps(_mm512_mul_ps(scale_high[j], zero_high), xz_high, acc[j]);
    }
}

/* Lanes 0-7 block b's d times its group's scale, lanes 8-15 block b + 1's (`pick`: each lane's group). */
QL_INLINE QL_VNNI __m512 ql_picked_scale(__m512 scale_low, __m512 scale_high, __m512i pick, __m512 d) {
    return _mm512_mul_ps(_mm512_permutex2var_ps(scale_low, pick, scale_high), d);
}

QL_INLINE QL_VNNI __m512i ql_pair_pick(int64_t b, int64_t per_group) {
    return _mm512_mask_blend_epi32((__mmask16)0xff00, _mm512_set1_epi32((int)(b / per_group)),
                                   _mm512_set1_epi32((int)((b + 1) / per_group)));
}

/* With a block per group (groups of 64), each group's d multiplied into the 4 features' scale registers once
 * (the same products, rounded the same), so that a pair's scale is one permute, not a permute and a multiply. */
QL_INLINE QL_VNNI void ql_fold_d(const ql_weight *w, const float *xd, __m512 *scale_low, __m512 *scale_high) {
    const int64_t G = w->groups, low_count = G < 16 ? G : 16, high_count = G - low_count;
    const __m512 xd_low = ql_load16(xd, QL_F32, 0, low_count);
    const __m512 xd_high = high_count ? ql_load16(xd, QL_F32, 16, high_count) : _mm512_setzero_ps();
    for (int j = 0; j < 4; j++) {
        scale_low[j] = _mm512_mul_ps(scale_low[j], xd_low);
        scale_high[j] = _mm512_mul_ps(scale_high[j], xd_high);
    }
}

/* ql_block_a8 for 4 features of at most 32 groups and rows under QL_BY_FEATURE_BYTES, block by block:
 * each pair of x's blocks is loaded once for the 4 features, whose 4 short rows lie in one run of memory
 * anyway. Faster at one row on every such shape measured (benchmarks/RESULTS.md). `folded`: a block per
 * group, d in the scales (ql_fold_d). */
QL_INLINE QL_VNNI void ql_block_a8_short_by_block(const int folded, const ql_weight *w, const int8_t *xq,
                                                  const float *xd, const float *xz, int64_t n, float *y) {
    const int64_t per_group = w->group_codes / 64, blocks = w->groups * per_group;
    const int64_t row_bytes = w->groups * w->group_bytes;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 scale_low[4], scale_high[4], acc[4];
    ql_short_start(w, xz, n, scale_low, scale_high, acc);
    if (folded) ql_fold_d(w, xd, scale_low, scale_high);
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        const __m512 d = folded ? _mm512_setzero_ps() /* unused */
                                : _mm512_insertf32x8(_mm512_set1_ps(xd[b]), _mm256_set1_ps(xd[b + 1]), 1);
        const __m512i pick = ql_pair_pick(b, per_group);
        for (int j = 0; j < 4; j++) {
            const __m512 dot = ql_pair_dot(w->codes + (n + j) * row_bytes + b * 32, xq + b * 64, low);
            const __m512 sd = folded ? _mm512_permutex2var_ps(scale_low[j], pick, scale_high[j])
                                     : ql_picked_scale(scale_low[j], scale_high[j], pick, d);
            acc[j] = _mm512_fmadd_ps(dot, sd, acc[j]);
        }
    }
    if (b < blocks) { /* the odd last block: [its lows, its highs] */
        const __m512i pick = _mm512_set1_epi32((int)(b / per_group));
        const __m512 d = _mm512_set1_ps(xd[b]);
        for (int j = 0; j < 4; j++) {
            const __m512 dot = ql_lone_dot(w->codes + (n + j) * row_bytes + b * 32, xq + b * 64, low);
            const __m512 sd = folded ? _mm512_permutex2var_ps(scale_low[j], pick, scale_high[j])
                                     : ql_picked_scale(scale_low[j], scale_high[j], pick, d);
            acc[j] = _mm512_fmadd_ps(dot, sd, acc[j]);
        }
    }
    ql_store_sums(4, acc, y + n);
}

/* The same for rows of QL_BY_FEATURE_BYTES or more, feature by feature: each feature's codes in order, as
 * they lie (ql_block_a8), its pairs a window at a time (their d and picks computed once for the 4), then
 * its odd last block. */
QL_INLINE QL_VNNI void ql_block_a8_short_by_feature(const ql_weight *w, const int8_t *xq, const float *xd,
                                                    const float *xz, int64_t n, float *y) {
    const int64_t per_group = w->group_codes / 64, blocks = w->groups * per_group;
    const int64_t row_bytes = w->groups * w->group_bytes, pairs = blocks / 2, lone = blocks - 1;
    const int has_lone = (int)(blocks % 2);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 scale_low[4], scale_high[4], acc[4];
    ql_short_start(w, xz, n, scale_low, scale_high, acc);
    const __m512i lone_pick = _mm512_set1_epi32((int)(lone / per_group));
    const __m512 lone_d = _mm512_set1_ps(has_lone ? xd[lone] : 0.0f);
    for (int64_t p0 = 0; p0 == 0 || p0 < pairs; p0 += QL_PAIR_WINDOW) {
        const int64_t count = pairs - p0 < QL_PAIR_WINDOW ? pairs - p0 : QL_PAIR_WINDOW;
        const int last = p0 + QL_PAIR_WINDOW >= pairs;
        __m512 d[QL_PAIR_WINDOW];
        __m512i pick[QL_PAIR_WINDOW];
        for (int64_t p = 0; p < count; p++) {
            const int64_t b = 2 * (p0 + p);
            d[p] = _mm512_insertf32x8(_mm512_set1_ps(xd[b]), _mm256_set1_ps(xd[b + 1]), 1);
            pick[p] = ql_pair_pick(b, per_group);
        }
        for (int j = 0; j < 4; j++) {
            const uint8_t *row = w->codes + (n + j) * row_bytes, *codes = row + p0 * 64;
            const int8_t *x = xq + p0 * 128;
            __m512 even = acc[j], odd = _mm512_setzero_ps(); /* two chains: FMA latency */
            int64_t p = 0;
            for (; p + 2 <= count; p += 2) {
                even = _mm512_fmadd_ps(ql_pair_dot(codes + p * 64, x + p * 128, low),
                                       ql_picked_scale(scale_low[j], scale_high[j], pick[p], d[p]), even);
                odd = _mm512_fmadd_ps(ql_pair_dot(codes + p * 64 + 64, x + p * 128 + 128, low),
                                      ql_picked_scale(scale_low[j], scale_high[j], pick[p + 1], d[p + 1]), odd);
            }
            if (p < count)
                even = _mm512_fmadd_ps(ql_pair_dot(codes + p * 64, x + p * 128, low),
                                       ql_picked_scale(scale_low[j], scale_high[j], pick[p], d[p]), even);
            if (last && has_lone)
                odd = _mm512_fmadd_ps(ql_lone_dot(row + lone * 32, xq + lone * 64, low),
                                      ql_picked_scale(scale_low[j], scale_high[j], lone_pick, lone_d), odd);
            acc[j] = _mm512_add_ps(even, odd);
        }
    }
    ql_store_sums(4, acc, y + n);
}

/* 4 features of at most 32 groups, one row: by block or by feature as their rows' length asks. */
QL_INLINE QL_VNNI void ql_block_a8_short(const ql_weight *w, const int8_t *xq, const float *xd, const float *xz,
                                         int64_t n, float *y) {
    if (w->groups * w->group_bytes >= QL_BY_FEATURE_BYTES)
        ql_block_a8_short_by_feature(w, xq, xd, xz, n, y);
    else if (w->group_codes == 64)
        ql_block_a8_short_by_block(1, w, xq, xd, xz, n, y);
    else
        ql_block_a8_short_by_block(0, w, xq, xd, xz, n, y);
}

/* NR features from n, one row, int8 codes: scale * d * float((q + 128) . xq - 128 * sum xq) per block,
 * the offset's share taken off exactly in int32 (in lane 0 of the vector vpdpbusd starts from). Each
 * feature's codes are read start to end before the next one's: 4 features are one contiguous run of
 * memory, read in order, which streams a large table (an output head) from DRAM much faster than
 * interleaving the 4 blocks by block as the 4-bit kernel does; on a weight that stays in L3 it is
 * somewhat slower than interleaved (timings in benchmarks/RESULTS.md). */
QL_INLINE QL_VNNI void ql_block_a8_int8(const int NR, const ql_weight *w, const int8_t *xq, const float *xd,
                                        const int32_t *xs, int64_t n, float *y, const float *params) {
    const int64_t G = w->groups, per_group = w->group_codes / 64;
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    for (int j = 0; j < NR; j++) {
        const uint8_t *codes = w->codes + (n + j) * G * w->group_bytes;
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(); /* two chains: FMA latency */
        for (int64_t g = 0, b = 0; g < G; g++) {
            const __m512 scale = _mm512_set1_ps(params[j * G + g]);
            for (int64_t i = 0; i < per_group; i++, b++) {
                const __m512i start = _mm512_zextsi128_si512(_mm_cvtsi32_si128(-128 * xs[b]));
                __m512i q = _mm512_xor_si512(_mm512_loadu_si512(codes + b * 64), offset);
                __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, q, _mm512_loadu_si512(xq + b * 64)));
                __m512 sd = _mm512_mul_ps(scale, _mm512_set1_ps(xd[b]));
                if (b & 1)
                    odd = _mm512_fmadd_ps(dot, sd, odd);
                else
                    even = _mm512_fmadd_ps(dot, sd, even);
            }
        }
        y[n + j] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
}

/* NR features from n, one row, as this weight's codes are stored. */
QL_INLINE QL_VNNI void ql_block_a8_of(const int int8, const int NR, const ql_weight *w, const int8_t *xq,
                                      const float *xd, const int32_t *xs, const float *xz, int64_t n, float *y,
                                      const float *params) {
    if (int8)
        ql_block_a8_int8(NR, w, xq, xd, xs, n, y, params);
    else
        ql_block_a8(NR, w, xq, xd, xz, n, y, params);
}

QL_INLINE QL_VNNI void ql_gemm512_a8_mode(const int int8, const ql_weight *w, const int8_t *xq, const float *xd,
                                          const int32_t *xs, int64_t m, int64_t row_length, int64_t n0, int64_t n1,
                                          float *y, int64_t y_stride, float *params, float *xz) {
    const int64_t G = w->groups, blocks = row_length / 64, block_bytes = 4 * G * w->group_bytes;
    const uint8_t *end = w->codes + n1 * G * w->group_bytes;
    ql_prefetch(w->codes + n0 * G * w->group_bytes, QL_PREFETCH_BLOCKS * block_bytes, end);
    if (!int8)
        for (int64_t r = 0; r < m; r++) ql_zero_terms(w, xd + r * blocks, xs + r * blocks, xz + r * G);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        ql_prefetch(w->codes + (n + 4 * QL_PREFETCH_BLOCKS) * G * w->group_bytes, block_bytes, end);
        if (!int8) ql_prefetch_l2(w->codes + (n + 4 * QL_PREFETCH_L2_BLOCKS) * G * w->group_bytes, block_bytes, end);
        if (!int8 && G <= 32) {
            for (int64_t r = 0; r < m; r++)
                ql_block_a8_short(w, xq + r * blocks * 64, xd + r * blocks, xz + r * G, n, y + r * y_stride);
            continue;
        }
        ql_params4_512(w, n, params);
        for (int64_t r = 0; r < m; r++)
            ql_block_a8_of(int8, 4, w, xq + r * blocks * 64, xd + r * blocks, xs + r * blocks, xz + r * G, n,
                           y + r * y_stride, params);
    }
    for (; n < n1; n++) {
        ql_params512(w, n, params, params + 4 * G);
        for (int64_t r = 0; r < m; r++)
            ql_block_a8_of(int8, 1, w, xq + r * blocks * 64, xd + r * blocks, xs + r * blocks, xz + r * G, n,
                           y + r * y_stride, params);
    }
}

/* y[r, n] for features [n0, n1) of a weight `ql_a8_eligible` accepts, x as ql_quantize_x_a8 left it;
 * params: scratch for 4 features' scales and zeros, xz: for m x groups floats. */
QL_VNNI void ql_gemm512_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m,
                           int64_t row_length, int64_t n0, int64_t n1, float *y, int64_t y_stride, float *params,
                           float *xz) {
    if (w->kind == QL_INT8)
        ql_gemm512_a8_mode(1, w, xq, xd, xs, m, row_length, n0, n1, y, y_stride, params, xz);
    else
        ql_gemm512_a8_mode(0, w, xq, xd, xs, m, row_length, n0, n1, y, y_stride, params, xz);
}
#endif
