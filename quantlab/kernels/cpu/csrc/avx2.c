/* The AVX2 kernels (AVX2 + FMA + F16C): one generic decoder, 8 weights a step. */
#include "quantlab_cpu.h"
#include "transpose8x8.h"

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

/* count stored floats (float32, float16 or bfloat16) from index first of an array of `total`,
 * converted exactly, into out, 8 a step. A tail of fewer than 8 is loaded whole when the array goes
 * on that far; only at the array's end is it converted one by one. (Copying it to a padded buffer
 * first stalled on the copy's stores: a third of the conversion's time in a decoding profile.) */
QL_INLINE QL_AVX2 __m256 ql_floats8(const uint16_t *halves, int32_t dtype) {
    const __m128i h = _mm_loadu_si128((const __m128i *)halves);
    return dtype == QL_F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

QL_INLINE QL_AVX2 void ql_floats256(const void *base, int32_t dtype, int64_t first, int64_t count, int64_t total,
                                    float *out) {
    if (dtype == QL_F32) {
        memcpy(out, (const float *)base + first, (size_t)count * sizeof(float));
        return;
    }
    const uint16_t *halves = (const uint16_t *)base + first;
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, ql_floats8(halves + i, dtype));
    if (i < count && first + i + 8 <= total) {
        float values[8]; /* not a masked store: vmaskmovps to memory is microcoded on AMD's cores */
        _mm256_storeu_ps(values, ql_floats8(halves + i, dtype));
        for (int64_t j = 0; i + j < count; j++) out[i + j] = values[j];
    } else {
        for (; i < count; i++) out[i] = ql_load_float(base, dtype, first + i);
    }
}

/* Scale and zero of every group of features [n, n + count), the values of ql_params_scalar, into
 * scale[j * groups + g] and zero[j * groups + g]: the features' parameters are stored side by side,
 * so they convert 8 groups a step across feature boundaries. In groups of 64, converting one float16
 * scale at a time took as long as the group's dot product; at 576 inputs (9 groups) a feature at a
 * time still left a scalar tail per feature. */
QL_AVX2 void ql_params256(const ql_weight *w, int64_t n, int count, float *scale, float *zero) {
    const int64_t G = w->groups;
    if (ql_table_kind(w) && w->absmax_codes) { /* double-quantized absmax: a table lookup per group */
        for (int j = 0; j < count; j++) ql_params_scalar(w, n + j, scale + j * G, zero + j * G);
        return;
    }
    ql_floats256(w->scale, w->scale_dtype, n * G, count * G, w->n * G, scale);
    if (!ql_table_kind(w) && w->zero)
        ql_floats256(w->zero, w->zero_dtype, n * G, count * G, w->n * G, zero);
    else
        for (int64_t g = 0; g < count * G; g++) zero[g] = ql_table_kind(w) ? 0.0f : w->zero_const;
}

/* At one row these kernels read 4 features' codes side by side: 4 short interleaved streams that
 * the hardware prefetcher follows late. Asking for group g of the next 4 features while this block
 * works on group g keeps the next block's codes on their way: more decoded tokens/s for 4-bit and
 * int8 (measured in benchmarks/RESULTS.md). */
QL_INLINE void ql_prefetch_next4(const ql_weight *w, int64_t n0, int NR, int64_t g) {
    for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(w->codes + ((n0 + j + 4) * w->groups + g) * w->group_bytes), _MM_HINT_T0);
}

typedef struct {
    __m256 low, high; /* NF4: levels 0-7 and 8-15, times absmax */
    __m256 zero, scale;
} ql_group256;

QL_INLINE QL_AVX2 ql_group256 ql_group256_make(const ql_weight *w, float scale, float zero) {
    ql_group256 out;
    out.zero = _mm256_set1_ps(zero);
    out.scale = _mm256_set1_ps(scale);
    if (ql_table_kind(w)) {
        out.low = _mm256_mul_ps(_mm256_loadu_ps(w->levels), out.scale);
        out.high = _mm256_mul_ps(_mm256_loadu_ps(w->levels + 8), out.scale);
    } else {
        out.low = out.high = out.scale;
    }
    return out;
}

/* 8 codes (int32, at most 4 bits above the code for NF4) as their values: NF4's level times absmax,
 * else (code - zero) * scale, the reference's dequantization bit for bit. */
QL_INLINE QL_AVX2 __m256 ql_decode8(const int nf4, __m256i codes, const ql_group256 *constants) {
    if (nf4) {
        __m256 low = _mm256_permutevar8x32_ps(constants->low, codes);
        __m256 high = _mm256_permutevar8x32_ps(constants->high, codes);
        return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
    }
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(codes), constants->zero), constants->scale);
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
    __m256i codes;
    if (w->bits == 8) { /* whole bytes: widened directly (int8 signed, 8-bit affine unsigned) */
        codes = w->kind == QL_INT8 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    } else {
        codes = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(bytes), bits->shuffle);
        codes = _mm256_and_si256(_mm256_srlv_epi32(codes, bits->shift), bits->mask);
    }
    return ql_decode8(ql_table_kind(w), codes, constants);
}

QL_INLINE QL_AVX2 void ql_block256(const int NR, const int R, const ql_weight *w, const ql_bits256 *bits,
                                   const ql_layout *layout, const float *xp, int64_t row_length, int64_t n0, float *y,
                                   int64_t y_stride, float *params) {
    const int64_t G = w->groups;
    ql_params256(w, n0, NR, params, params + NR * G);
    __m256 acc[4][4];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w->groups; g++) {
        const uint8_t *group[4];
        ql_group256 constants[4];
        for (int j = 0; j < NR; j++) {
            int64_t index = (n0 + j) * w->groups + g;
            group[j] = w->codes + index * w->group_bytes;
            constants[j] = ql_group256_make(w, params[j * G + g], params[(NR + j) * G + g]);
        }
        if (R == 1) ql_prefetch_next4(w, n0, NR, g);
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

/* NF4 codes in groups of whole chunks of 32, x in the nibble layout (ql_prepare_x: a chunk's even
 * inputs, then its odd ones, as on AVX-512): 8 bytes of a chunk widened once give 8 even codes (low
 * nibbles) and 8 odd ones (high nibbles), where the generic decoder shuffles and shifts per 8 codes.
 * Same values as the generic decoder (ql_decode8). One row keeps two accumulators per feature, so
 * FMA latency does not bound it. Affine 4-bit codes take the block below. */
QL_INLINE QL_AVX2 void ql_block256_nf4(const int NR, const int R, const ql_weight *w, const ql_layout *layout,
                                       const float *xp, int64_t row_length, int64_t n0, float *y, int64_t y_stride,
                                       float *params) {
    const int A = R == 1 ? 2 : 1;
    const int64_t G = w->groups;
    const __m256i low_nibble = _mm256_set1_epi32(15);
    ql_params256(w, n0, NR, params, params + NR * G);
    __m256 acc[4][4][2];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++)
            for (int a = 0; a < A; a++) acc[j][r][a] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *group[4];
        ql_group256 constants[4];
        for (int j = 0; j < NR; j++) {
            group[j] = w->codes + ((n0 + j) * G + g) * w->group_bytes;
            constants[j] = ql_group256_make(w, params[j * G + g], params[(NR + j) * G + g]);
        }
        if (R == 1) ql_prefetch_next4(w, n0, NR, g);
        const float *xg = xp + g * layout->padded_group;
        for (int64_t c = 0; c < w->group_codes; c += 32) {
            for (int64_t half = 0; half < 16; half += 8) {
                for (int j = 0; j < NR; j++) {
                    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(group[j] + c / 2 + half));
                    const __m256i packed = _mm256_cvtepu8_epi32(bytes);
                    const __m256 even = ql_decode8(1, _mm256_and_si256(packed, low_nibble), &constants[j]);
                    const __m256 odd = ql_decode8(1, _mm256_srli_epi32(packed, 4), &constants[j]);
                    for (int r = 0; r < R; r++) {
                        const float *xr = xg + r * row_length + c + half;
                        acc[j][r][0] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xr), acc[j][r][0]);
                        acc[j][r][A - 1] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xr + 16), acc[j][r][A - 1]);
                    }
                }
            }
        }
    }
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++)
            y[r * y_stride + n0 + j] = ql_sum256(A == 2 ? _mm256_add_ps(acc[j][r][0], acc[j][r][1]) : acc[j][r][0]);
}

/* The nibble block for affine codes: per group, the codes as they are times x are summed (one
 * conversion and one FMA per 8 codes), then scaled: y += s * sum(q * x) - s * z * sum(x), with sum(x)
 * of each group of a row taken once for the 4 features. Not the reference's order of rounding
 * ((q - z) * s per weight, then the dot product), but within float32 summation error of it. It is
 * faster at one row than the generic decoder and than a nibble block that computes each weight's
 * value (timings in benchmarks/RESULTS.md). */
QL_INLINE QL_AVX2 void ql_block256_affine4(const int NR, const int R, const ql_weight *w, const ql_layout *layout,
                                           const float *xp, int64_t row_length, int64_t n0, float *y, int64_t y_stride,
                                           float *params) {
    const int64_t G = w->groups;
    const __m256i low_nibble = _mm256_set1_epi32(15);
    ql_params256(w, n0, NR, params, params + NR * G);
    __m256 acc[4][4];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *group[4];
        __m256 dot[4][4], xsum[4];
        for (int j = 0; j < NR; j++) {
            group[j] = w->codes + ((n0 + j) * G + g) * w->group_bytes;
            for (int r = 0; r < R; r++) dot[j][r] = _mm256_setzero_ps();
        }
        for (int r = 0; r < R; r++) xsum[r] = _mm256_setzero_ps();
        if (R == 1) ql_prefetch_next4(w, n0, NR, g);
        const float *xg = xp + g * layout->padded_group;
        for (int64_t c = 0; c < w->group_codes; c += 32) {
            for (int64_t half = 0; half < 16; half += 8) {
                __m256 even_x[4], odd_x[4];
                for (int r = 0; r < R; r++) {
                    even_x[r] = _mm256_loadu_ps(xg + r * row_length + c + half);
                    odd_x[r] = _mm256_loadu_ps(xg + r * row_length + c + half + 16);
                    xsum[r] = _mm256_add_ps(xsum[r], _mm256_add_ps(even_x[r], odd_x[r]));
                }
                for (int j = 0; j < NR; j++) {
                    const __m256i packed = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(group[j] + c / 2 + half)));
                    const __m256 even = _mm256_cvtepi32_ps(_mm256_and_si256(packed, low_nibble));
                    const __m256 odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(packed, 4));
                    for (int r = 0; r < R; r++)
                        dot[j][r] = _mm256_fmadd_ps(odd, odd_x[r], _mm256_fmadd_ps(even, even_x[r], dot[j][r]));
                }
            }
        }
        for (int j = 0; j < NR; j++) {
            const float scale = params[j * G + g], zero = params[(NR + j) * G + g];
            const __m256 s = _mm256_set1_ps(scale), sz = _mm256_set1_ps(scale * zero);
            for (int r = 0; r < R; r++) acc[j][r] = _mm256_fnmadd_ps(xsum[r], sz, _mm256_fmadd_ps(dot[j][r], s, acc[j][r]));
        }
    }
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) y[r * y_stride + n0 + j] = ql_sum256(acc[j][r]);
}

/* The 8 bytes from `at` of a group with fewer than 8 left: the group's last 8 shifted down (copying
 * them out to a padded buffer stalled on store forwarding), or copied when the group is shorter. */
QL_INLINE QL_AVX2 __m128i ql_group_tail(const ql_weight *w, const uint8_t *group, int64_t at) {
    const int64_t left = w->group_bytes - at;
    if (w->group_bytes >= 8) {
        const __m128i last = _mm_loadl_epi64((const __m128i *)(group + w->group_bytes - 8));
        return _mm_srl_epi64(last, _mm_cvtsi32_si128((int)(8 * (8 - left))));
    }
    uint8_t tail[8] = {0};
    memcpy(tail, group + at, (size_t)left);
    return _mm_loadl_epi64((const __m128i *)tail);
}

/* The block for 8-bit codes (int8, and 8-bit affine): per group the codes as they are times x are
 * summed (one widening load, one conversion and one FMA per 8 codes), then scaled, y += s * sum(q * x)
 * - s * z * sum(x), as the affine nibble block does (within float32 summation error of the
 * reference's order). The generic decoder branched per 8 codes on the width and the group's end and
 * kept its accumulators on the stack, several times slower (benchmarks/RESULTS.md). */
QL_INLINE QL_AVX2 __m256 ql_bytes8(const int is_signed, __m128i bytes) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

QL_INLINE QL_AVX2 void ql_block256_bytes(const int is_signed, const int NR, const int R, const ql_weight *w,
                                         const ql_layout *layout, const float *xp, int64_t row_length, int64_t n0,
                                         float *y, int64_t y_stride, float *params) {
    const int64_t G = w->groups, whole = w->group_codes / 8 * 8;
    ql_params256(w, n0, NR, params, params + NR * G);
    __m256 acc[4][4];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *group[4];
        __m256 dot[4][4], xsum[4];
        for (int j = 0; j < NR; j++) {
            group[j] = w->codes + ((n0 + j) * G + g) * w->group_bytes;
            for (int r = 0; r < R; r++) dot[j][r] = _mm256_setzero_ps();
        }
        for (int r = 0; r < R; r++) xsum[r] = _mm256_setzero_ps();
        if (R == 1) ql_prefetch_next4(w, n0, NR, g);
        const float *xg = xp + g * layout->padded_group;
        for (int64_t c = 0; c < w->group_codes; c += 8) {
            __m256 xv[4], q[4];
            for (int r = 0; r < R; r++) {
                xv[r] = _mm256_loadu_ps(xg + r * row_length + c);
                xsum[r] = _mm256_add_ps(xsum[r], xv[r]);
            }
            if (c < whole) {
                for (int j = 0; j < NR; j++) q[j] = ql_bytes8(is_signed, _mm_loadl_epi64((const __m128i *)(group[j] + c)));
            } else { /* the group's last codes; x is zero past them (ql_prepare_x pads it) */
                for (int j = 0; j < NR; j++) q[j] = ql_bytes8(is_signed, ql_group_tail(w, group[j], c));
            }
            for (int j = 0; j < NR; j++)
                for (int r = 0; r < R; r++) dot[j][r] = _mm256_fmadd_ps(q[j], xv[r], dot[j][r]);
        }
        for (int j = 0; j < NR; j++) {
            const float scale = params[j * G + g], zero = params[(NR + j) * G + g];
            const __m256 s = _mm256_set1_ps(scale), sz = _mm256_set1_ps(scale * zero);
            for (int r = 0; r < R; r++) acc[j][r] = _mm256_fnmadd_ps(xsum[r], sz, _mm256_fmadd_ps(dot[j][r], s, acc[j][r]));
        }
    }
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) y[r * y_stride + n0 + j] = ql_sum256(acc[j][r]);
}

/* The block for affine codes of 2 to 7 bits outside the nibble layout (3-bit, 5-bit, ...): per group
 * the codes as they are times x, then scaled, as the blocks above; the codes unpacked as the generic
 * decoder unpacks them (ql_values8), whose per-weight centring and scaling this leaves out; it is
 * several times faster than the generic decoder at one row. It has the 8-bit block's shape; one
 * function for both (the unpacking a compile-time choice) made int8 slower at one row, so they stay
 * two (timings in benchmarks/RESULTS.md). */
QL_INLINE QL_AVX2 void ql_block256_codes(const int NR, const int R, const ql_weight *w, const ql_bits256 *bits,
                                         const ql_layout *layout, const float *xp, int64_t row_length, int64_t n0,
                                         float *y, int64_t y_stride, float *params) {
    const int64_t G = w->groups;
    ql_params256(w, n0, NR, params, params + NR * G);
    __m256 acc[4][4];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *group[4];
        __m256 dot[4][4], xsum[4];
        for (int j = 0; j < NR; j++) {
            group[j] = w->codes + ((n0 + j) * G + g) * w->group_bytes;
            for (int r = 0; r < R; r++) dot[j][r] = _mm256_setzero_ps();
        }
        for (int r = 0; r < R; r++) xsum[r] = _mm256_setzero_ps();
        if (R == 1) ql_prefetch_next4(w, n0, NR, g);
        const float *xg = xp + g * layout->padded_group;
        for (int64_t c = 0; c < w->group_codes; c += 8) {
            __m256 xv[4], q[4];
            for (int r = 0; r < R; r++) {
                xv[r] = _mm256_loadu_ps(xg + r * row_length + c);
                xsum[r] = _mm256_add_ps(xsum[r], xv[r]);
            }
            const int64_t at = c * w->bits / 8, left = w->group_bytes - at;
            for (int j = 0; j < NR; j++) {
                const __m128i bytes = left >= 8 ? _mm_loadl_epi64((const __m128i *)(group[j] + at))
                                                : ql_group_tail(w, group[j], at);
                const __m256i codes = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(bytes), bits->shuffle);
                q[j] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(codes, bits->shift), bits->mask));
            }
            for (int j = 0; j < NR; j++)
                for (int r = 0; r < R; r++) dot[j][r] = _mm256_fmadd_ps(q[j], xv[r], dot[j][r]);
        }
        for (int j = 0; j < NR; j++) {
            const float scale = params[j * G + g], zero = params[(NR + j) * G + g];
            const __m256 s = _mm256_set1_ps(scale), sz = _mm256_set1_ps(scale * zero);
            for (int r = 0; r < R; r++) acc[j][r] = _mm256_fnmadd_ps(xsum[r], sz, _mm256_fmadd_ps(dot[j][r], s, acc[j][r]));
        }
    }
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++) y[r * y_stride + n0 + j] = ql_sum256(acc[j][r]);
}

/* How a block decodes its codes: a compile-time constant of each copy of the loops below, so no
 * branch runs per 8 codes. */
enum { QL256_GENERIC, QL256_NF4_NIBBLE, QL256_AFFINE_NIBBLE, QL256_BYTES, QL256_CODES, QL256_TABLE_CODES };

QL_INLINE QL_AVX2 void ql_block256_of(const int decoder, const int NR, const int R, const ql_weight *w,
                                      const ql_bits256 *bits, const ql_layout *layout, const float *xp,
                                      int64_t row_length, int64_t n0, float *y, int64_t y_stride, float *params) {
    if (decoder == QL256_NF4_NIBBLE)
        ql_block256_nf4(NR, R, w, layout, xp, row_length, n0, y, y_stride, params);
    else if (decoder == QL256_AFFINE_NIBBLE)
        ql_block256_affine4(NR, R, w, layout, xp, row_length, n0, y, y_stride, params);
    else if (decoder == QL256_BYTES && w->kind == QL_INT8)
        ql_block256_bytes(1, NR, R, w, layout, xp, row_length, n0, y, y_stride, params);
    else if (decoder == QL256_BYTES)
        ql_block256_bytes(0, NR, R, w, layout, xp, row_length, n0, y, y_stride, params);
    else if (decoder == QL256_CODES)
        ql_block256_codes(NR, R, w, bits, layout, xp, row_length, n0, y, y_stride, params);
    else
        ql_block256(NR, R, w, bits, layout, xp, row_length, n0, y, y_stride, params);
}

/* ---- dequantization: weights decoded into float32 rows (the panels below, the input gradient) ---- */

/* 8 values into out[0, count), count < 8: through a buffer, so nothing past the row is written (the
 * next row may be another thread's). */
QL_INLINE QL_AVX2 void ql_store_part(float *out, __m256 values, int64_t count) {
    float part[8];
    _mm256_storeu_ps(part, values);
    memcpy(out, part, (size_t)count * sizeof(float));
}

/* The valid codes of one group into out, each the reference's value bit for bit ((q - zero) * scale,
 * or NF4's level times absmax). The decoder is a compile-time constant, so the inner loops hold no
 * branch: 4-bit codes 32 a step (16 bytes split into low and high nibbles, interleaved back into
 * their order as bytes), 8-bit ones 8 a step by one widening load, 2-7-bit ones 8 a step by shuffle
 * and shift (a group's last bytes read by ql_group_tail: copied out, they stalled on store forwarding),
 * codes past the last 8 of a row through the generic decoder. The generic decoder for every code (a
 * branch per 8 on the width and the group's end) is much slower (benchmarks/RESULTS.md). */
QL_INLINE QL_AVX2 void ql_dequantize_group256(const int decoder, const ql_weight *w, const ql_bits256 *bits,
                                              const uint8_t *group, int64_t valid, const ql_group256 *constants,
                                              float *out) {
    int64_t c = 0;
    if (decoder == QL256_AFFINE_NIBBLE || decoder == QL256_NF4_NIBBLE) {
        const int nf4 = decoder == QL256_NF4_NIBBLE;
        const __m128i low_nibbles = _mm_set1_epi8(15);
        for (; c + 32 <= valid; c += 32) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(group + c / 2));
            const __m128i low = _mm_and_si128(bytes, low_nibbles);
            const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
            const __m128i first = _mm_unpacklo_epi8(low, high), second = _mm_unpackhi_epi8(low, high);
            _mm256_storeu_ps(out + c, ql_decode8(nf4, _mm256_cvtepu8_epi32(first), constants));
            _mm256_storeu_ps(out + c + 8, ql_decode8(nf4, _mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)), constants));
            _mm256_storeu_ps(out + c + 16, ql_decode8(nf4, _mm256_cvtepu8_epi32(second), constants));
            _mm256_storeu_ps(out + c + 24, ql_decode8(nf4, _mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)), constants));
        }
    } else if (decoder == QL256_BYTES) {
        for (; c + 8 <= valid; c += 8) {
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(group + c));
            const __m256i codes = w->kind == QL_INT8 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
            _mm256_storeu_ps(out + c, ql_decode8(0, codes, constants));
        }
    } else if (decoder == QL256_CODES || decoder == QL256_TABLE_CODES) { /* 2-7-bit integers, or 2-3-bit table codes */
        const int table = decoder == QL256_TABLE_CODES;
        for (; c + 8 <= valid; c += 8) {
            const int64_t at = c * w->bits / 8;
            const __m128i bytes = at + 8 <= w->group_bytes ? _mm_loadl_epi64((const __m128i *)(group + at))
                                                           : ql_group_tail(w, group, at);
            const __m256i codes = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(bytes), bits->shuffle);
            _mm256_storeu_ps(out + c, ql_decode8(table, _mm256_and_si256(_mm256_srlv_epi32(codes, bits->shift), bits->mask),
                                                 constants));
        }
    }
    for (; c < valid; c += 8) {
        const __m256 values = ql_values8(w, bits, group, c, constants);
        if (valid - c >= 8)
            _mm256_storeu_ps(out + c, values);
        else
            ql_store_part(out + c, values, valid - c);
    }
}

/* 4 features' weights decoded into `decoded` (4 rows of row_length, in the plain layout of x: each
 * group's values, then zeros up to padded_group), for the panels and ql_micro256: the values of the
 * dequantization above, the reference's bit for bit. */
QL_INLINE QL_AVX2 void ql_decode4_256(const int decoder, const ql_weight *w, const ql_bits256 *bits,
                                      const ql_layout *layout, int64_t n0, float *decoded, float *params) {
    const int64_t G = w->groups, padded = layout->padded_group, row_length = G * padded;
    ql_params256(w, n0, 4, params, params + 4 * G);
    for (int j = 0; j < 4; j++) {
        const float *scale = params + j * G, *zero = params + (4 + j) * G;
        for (int64_t g = 0; g < G; g++) {
            const int64_t first = g * w->group_size;
            const int64_t valid = w->group_size < w->k - first ? w->group_size : w->k - first;
            const ql_group256 constants = ql_group256_make(w, scale[g], zero[g]);
            float *out = decoded + j * row_length + g * padded;
            ql_dequantize_group256(decoder, w, bits, w->codes + ((n0 + j) * G + g) * w->group_bytes, valid,
                                   &constants, out);
            if (valid < padded) memset(out + valid, 0, (size_t)(padded - valid) * sizeof(float));
        }
    }
}

/* From this many rows on the panels below; fewer rows take blocks of 4 decoded features times 3 rows
 * (ql_micro256), where decoding and transposing a panel is paid for by too few rows. Measured side by
 * side on small-model shapes (benchmarks/RESULTS.md): the 4-feature blocks are faster up to 32 rows
 * for every format, the panels from 48 rows on. */
#define QL_AVX2_PANEL_ROWS 48
#define QL_PANEL_INPUTS 256 /* inputs a pass (ql_gemm256_decoded): 16 KiB of a panel stay in L1 */

/* y[r, n0..n0+3] (added to its value so far unless k0 is 0) for R rows (at most 3) of x times 4 decoded
 * features over inputs [k0, k1): 12 accumulators, each weight and each input loaded once per step of 8
 * for all of them, so the product runs at the FMA units' speed; a row's 4 sums come out of 3 hadds
 * together rather than 4 horizontal sums. */
QL_INLINE QL_AVX2 void ql_micro256(const int R, const float *decoded, int64_t row_length, int64_t k0, int64_t k1,
                                   const float *xr, int64_t x_stride, int64_t n0, float *yr, int64_t y_stride) {
    __m256 acc[4][3];
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < R; r++) acc[j][r] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k += 8) {
        __m256 xv[3];
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(xr + r * x_stride + k);
        for (int j = 0; j < 4; j++) {
            const __m256 wv = _mm256_loadu_ps(decoded + j * row_length + k);
            for (int r = 0; r < R; r++) acc[j][r] = _mm256_fmadd_ps(wv, xv[r], acc[j][r]);
        }
    }
    for (int r = 0; r < R; r++) { /* the 4 features' sums of row r side by side: 3 hadds and one add */
        const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][r], acc[1][r]), _mm256_hadd_ps(acc[2][r], acc[3][r]));
        __m128 sums = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
        float *out = yr + r * y_stride + n0;
        if (k0) sums = _mm_add_ps(_mm_loadu_ps(out), sums);
        _mm_storeu_ps(out, sums);
    }
}

/* y[r, n0..n0+15] (added to its value so far unless k0 is 0) for R rows (at most 6) of x times a panel
 * of 16 decoded features (panel[k * 16 + j], input-major) over inputs [k0, k1): the outer-product form
 * of BLAS kernels, 12 accumulators, per input 2 weight loads and R broadcasts of x for 2R FMAs, and
 * no horizontal sums (each accumulator holds 8 outputs). */
QL_INLINE QL_AVX2 void ql_panel256(const int R, const float *panel, int64_t k0, int64_t k1, const float *xr,
                                   int64_t x_stride, int64_t n0, float *yr, int64_t y_stride) {
    __m256 acc[6][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k++) {
        const __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(xr + r * x_stride + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *out = yr + r * y_stride + n0;
        if (k0) {
            acc[r][0] = _mm256_add_ps(_mm256_loadu_ps(out), acc[r][0]);
            acc[r][1] = _mm256_add_ps(_mm256_loadu_ps(out + 8), acc[r][1]);
        }
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
    }
}

/* Many rows: from QL_AVX2_PANEL_ROWS rows on, features in panels of 16, each decoded once
 * (ql_decode4_256, the plain layout of x), transposed input-major and multiplied by every row of x, 6
 * rows at a time (ql_panel256), a pass of QL_PANEL_INPUTS inputs at a time so that the panel's part
 * (16 KiB) stays in L1 while the rows go by. The 3 rows x 4 features dot-product kernel (ql_micro256)
 * fell behind torch's fp32 GEMM at many rows (12 horizontal sums per block, x read once per 4
 * features; benchmarks/RESULTS.md); below QL_AVX2_PANEL_ROWS rows, and for
 * features left over past the last panel, it takes blocks of 4 decoded features; the last features
 * one at a time (`block`: the decoder of the plain layout). */
QL_INLINE QL_AVX2 void ql_gemm256_decoded(const int decoder, const int block, const ql_weight *w,
                                          const ql_layout *layout, const float *xp, int64_t x_stride, int64_t m,
                                          int64_t n0, int64_t n1, float *y, int64_t y_stride, float *params,
                                          float *decoded) {
    ql_bits256 bits = ql_bits256_make(w->bits);
    const int64_t row_length = w->groups * layout->padded_group;
    const int64_t passes = (row_length + QL_PANEL_INPUTS - 1) / QL_PANEL_INPUTS;
    const int64_t pass = ql_round_up((row_length + passes - 1) / passes, 8); /* equal passes */
    float *panel = decoded + 16 * row_length;
    int64_t n = n0;
    for (; m >= QL_AVX2_PANEL_ROWS && n + 16 <= n1; n += 16) {
        for (int64_t j = 0; j < 16; j += 4) ql_decode4_256(decoder, w, &bits, layout, n + j, decoded + j * row_length, params);
        for (int64_t k = 0; k < row_length; k += 8)
            for (int64_t half = 0; half < 16; half += 8)
                ql_transpose8x8(decoded + half * row_length + k, row_length, panel + k * 16 + half, 16);
        for (int64_t k0 = 0; k0 < row_length; k0 += pass) {
            const int64_t k1 = row_length - k0 <= pass ? row_length : k0 + pass;
            int64_t r = 0;
            for (; r + 6 <= m; r += 6) ql_panel256(6, panel, k0, k1, xp + r * x_stride, x_stride, n, y + r * y_stride, y_stride);
            const float *xr = xp + r * x_stride;
            float *yr = y + r * y_stride;
            switch (m - r) {
            case 5: ql_panel256(5, panel, k0, k1, xr, x_stride, n, yr, y_stride); break;
            case 4: ql_panel256(4, panel, k0, k1, xr, x_stride, n, yr, y_stride); break;
            case 3: ql_panel256(3, panel, k0, k1, xr, x_stride, n, yr, y_stride); break;
            case 2: ql_panel256(2, panel, k0, k1, xr, x_stride, n, yr, y_stride); break;
            case 1: ql_panel256(1, panel, k0, k1, xr, x_stride, n, yr, y_stride); break;
            default: break;
            }
        }
    }
    for (; n + 4 <= n1; n += 4) {
        ql_decode4_256(decoder, w, &bits, layout, n, decoded, params);
        for (int64_t k0 = 0; k0 < row_length; k0 += pass) {
            const int64_t k1 = row_length - k0 <= pass ? row_length : k0 + pass;
            int64_t r = 0;
            for (; r + 3 <= m; r += 3)
                ql_micro256(3, decoded, row_length, k0, k1, xp + r * x_stride, x_stride, n, y + r * y_stride, y_stride);
            if (m - r == 2) ql_micro256(2, decoded, row_length, k0, k1, xp + r * x_stride, x_stride, n, y + r * y_stride, y_stride);
            if (m - r == 1) ql_micro256(1, decoded, row_length, k0, k1, xp + r * x_stride, x_stride, n, y + r * y_stride, y_stride);
        }
    }
    for (; n < n1; n++)
        for (int64_t r = 0; r < m; r++)
            ql_block256_of(block, 1, 1, w, &bits, layout, xp + r * x_stride, row_length, n, y + r * y_stride,
                           y_stride, params);
}

/* Features in blocks of 4 (one row), 2 x 2 or 1 x 4 (features x rows), the rest one by one. */
QL_INLINE QL_AVX2 void ql_gemm256_with(const int decoder, const ql_weight *w, const ql_layout *layout,
                                       const float *xp, int64_t m, int64_t n0, int64_t n1, float *y, int64_t y_stride,
                                       float *params) {
    ql_bits256 bits = ql_bits256_make(w->bits);
    int64_t row_length = w->groups * layout->padded_group;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        for (int64_t r = 0; r < m;) {
            const float *xr = xp + r * row_length;
            float *yr = y + r * y_stride;
            if (m - r >= 4) {
                for (int j = 0; j < 4; j++)
                    ql_block256_of(decoder, 1, 4, w, &bits, layout, xr, row_length, n + j, yr, y_stride, params);
                r += 4;
            } else if (m - r >= 2) {
                ql_block256_of(decoder, 2, 2, w, &bits, layout, xr, row_length, n, yr, y_stride, params);
                ql_block256_of(decoder, 2, 2, w, &bits, layout, xr, row_length, n + 2, yr, y_stride, params);
                r += 2;
            } else {
                ql_block256_of(decoder, 4, 1, w, &bits, layout, xr, row_length, n, yr, y_stride, params);
                r += 1;
            }
        }
    }
    for (; n < n1; n++)
        for (int64_t r = 0; r < m; r++)
            ql_block256_of(decoder, 1, 1, w, &bits, layout, xp + r * row_length, row_length, n, y + r * y_stride,
                           y_stride, params);
}

QL_AVX2 void ql_gemm256(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t x_stride, int64_t m, int64_t n0,
                        int64_t n1, float *y, int64_t y_stride, float *params, float *decoded) {
    if (decoded) { /* many rows, x in the plain layout (ql_layout_for) */
        if (ql_table_kind(w) && w->bits == 4)
            ql_gemm256_decoded(QL256_NF4_NIBBLE, QL256_GENERIC, w, layout, xp, x_stride, m, n0, n1, y, y_stride, params, decoded);
        else if (ql_table_kind(w))
            ql_gemm256_decoded(QL256_TABLE_CODES, QL256_GENERIC, w, layout, xp, x_stride, m, n0, n1, y, y_stride, params, decoded);
        else if (w->bits == 4)
            ql_gemm256_decoded(QL256_AFFINE_NIBBLE, QL256_CODES, w, layout, xp, x_stride, m, n0, n1, y, y_stride, params, decoded);
        else if (w->bits == 8)
            ql_gemm256_decoded(QL256_BYTES, QL256_BYTES, w, layout, xp, x_stride, m, n0, n1, y, y_stride, params, decoded);
        else
            ql_gemm256_decoded(QL256_CODES, QL256_CODES, w, layout, xp, x_stride, m, n0, n1, y, y_stride, params, decoded);
    } else if (!layout->nibble && w->bits == 8 && !ql_table_kind(w))
        ql_gemm256_with(QL256_BYTES, w, layout, xp, m, n0, n1, y, y_stride, params);
    else if (!layout->nibble && w->kind == QL_AFFINE)
        ql_gemm256_with(QL256_CODES, w, layout, xp, m, n0, n1, y, y_stride, params);
    else if (!layout->nibble)
        ql_gemm256_with(QL256_GENERIC, w, layout, xp, m, n0, n1, y, y_stride, params);
    else if (ql_table_kind(w))
        ql_gemm256_with(QL256_NF4_NIBBLE, w, layout, xp, m, n0, n1, y, y_stride, params);
    else
        ql_gemm256_with(QL256_AFFINE_NIBBLE, w, layout, xp, m, n0, n1, y, y_stride, params);
}

QL_INLINE QL_AVX2 void ql_dequantize256_with(const int decoder, const ql_weight *w, int64_t n0, int64_t n1, float *out,
                                             int64_t out_stride, float *params) {
    const ql_bits256 bits = ql_bits256_make(w->bits);
    const int64_t G = w->groups;
    for (int64_t n = n0; n < n1; n++) {
        float *row = out + (n - n0) * out_stride;
        ql_params256(w, n, 1, params, params + G);
        for (int64_t g = 0; g < G; g++) {
            const int64_t first = g * w->group_size;
            const int64_t valid = w->group_size < w->k - first ? w->group_size : w->k - first;
            const ql_group256 constants = ql_group256_make(w, params[g], params[G + g]);
            ql_dequantize_group256(decoder, w, &bits, w->codes + (n * G + g) * w->group_bytes, valid, &constants,
                                   row + first);
        }
    }
}

QL_AVX2 void ql_dequantize256(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride,
                              float *params) {
    if (w->bits == 4 && ql_table_kind(w))
        ql_dequantize256_with(QL256_NF4_NIBBLE, w, n0, n1, out, out_stride, params);
    else if (ql_table_kind(w))
        ql_dequantize256_with(QL256_TABLE_CODES, w, n0, n1, out, out_stride, params);
    else if (w->bits == 4)
        ql_dequantize256_with(QL256_AFFINE_NIBBLE, w, n0, n1, out, out_stride, params);
    else if (w->bits == 8)
        ql_dequantize256_with(QL256_BYTES, w, n0, n1, out, out_stride, params);
    else
        ql_dequantize256_with(QL256_CODES, w, n0, n1, out, out_stride, params);
}
#endif
