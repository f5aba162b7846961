/* The AVX-512 kernels (AVX512F/BW/VL/DQ): decoding codes in registers, 16 weights a step. */
#include "quantlab_cpu.h"
#include "transpose8x8.h"

#ifdef QL_X86
/* ---- AVX-512 --------------------------------------------------------------------------------- */


typedef struct {
    __m512i shuffle; /* generic mode: bytes of code j into dword j */
    __m512i shift;
    __m512i mask;
} ql_bits512;

static QL_AVX512 ql_bits512 ql_bits512_make(int bits) {
    uint8_t shuffle[64];
    int32_t shift[16];
    for (int j = 0; j < 16; j++) {
        int bit = j * bits, byte = bit >> 3, lane = j / 4, at = lane * 16 + (j % 4) * 4;
        shuffle[at] = (uint8_t)byte;
        shuffle[at + 1] = byte + 1 < 16 ? (uint8_t)(byte + 1) : 0x80;
        shuffle[at + 2] = shuffle[at + 3] = 0x80;
        shift[j] = bit & 7;
    }
    ql_bits512 constants;
    constants.shuffle = _mm512_loadu_si512(shuffle);
    constants.shift = _mm512_loadu_si512(shift);
    constants.mask = _mm512_set1_epi32((1 << bits) - 1);
    return constants;
}

QL_AVX512 void ql_params512(const ql_weight *w, int64_t n, float *scale, float *zero) {
    int64_t first = n * w->groups;
    if (ql_table_kind(w) && w->absmax_codes) {
        /* Double-quantized absmax: scalar lookups. Two 16-lane gathers per 16 groups were slower
         * (benchmarks/RESULTS.md); with scalar lookups NF4 runs as fast as 4-bit. */
        for (int64_t g = 0; g < w->groups; g++) {
            scale[g] = ql_group_at(w, first + g).scale;
            zero[g] = 0.0f;
        }
        return;
    }
    for (int64_t g = 0; g < w->groups; g += 16) {
        int64_t count = w->groups - g;
        __mmask16 mask = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
        _mm512_mask_storeu_ps(scale + g, mask, ql_load16(w->scale, w->scale_dtype, first + g, count));
        __m512 z = ql_table_kind(w) ? _mm512_setzero_ps()
                   : w->zero         ? ql_load16(w->zero, w->zero_dtype, first + g, count)
                                     : _mm512_set1_ps(w->zero_const);
        _mm512_mask_storeu_ps(zero + g, mask, z);
    }
}

/* Scales of features n..n+3 side by side, then their zeros (feature j's at params + jG and params + (4 + j)G),
 * converted 16 at a time across rows: on short rows four ql_params512 calls cost about as much as the
 * int8-activation arithmetic. Faster at one row for 4-bit (int8 and float activations) and int8; NF4
 * unchanged (double quantization converts row by row as before); timings in benchmarks/RESULTS.md. */
QL_AVX512 void ql_params4_512(const ql_weight *w, int64_t n, float *params) {
    const int64_t G = w->groups, count = 4 * G, first = n * G;
    if (ql_table_kind(w) && w->absmax_codes) {
        for (int j = 0; j < 4; j++) ql_params512(w, n + j, params + j * G, params + (4 + j) * G);
        return;
    }
    for (int64_t i = 0; i < count; i += 16) {
        int64_t left = count - i;
        __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        _mm512_mask_storeu_ps(params + i, mask, ql_load16(w->scale, w->scale_dtype, first + i, left));
        __m512 z = ql_table_kind(w) ? _mm512_setzero_ps()
                   : w->zero         ? ql_load16(w->zero, w->zero_dtype, first + i, left)
                                     : _mm512_set1_ps(w->zero_const);
        _mm512_mask_storeu_ps(params + count + i, mask, z);
    }
}

/* Decode constants of one group: a 16-entry table (codes of <= 4 bits) or zero and scale. */
typedef struct {
    __m512 table;
    __m512 zero;
    __m512 scale;
} ql_group512;

QL_INLINE QL_AVX512 ql_group512 ql_group512_make(const ql_weight *w, float scale, float zero, int use_table) {
    ql_group512 out;
    out.scale = _mm512_set1_ps(scale);
    out.zero = _mm512_set1_ps(zero);
    if (use_table) {
        __m512 base = ql_table_kind(w)
                          ? _mm512_loadu_ps(w->levels)
                          : _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), out.zero);
        out.table = _mm512_mul_ps(base, out.scale);
    } else {
        out.table = out.scale;
    }
    return out;
}

/* Codes [c, c + 16) of a group as 16 int32, for the byte and generic modes. A load reads 16
 * bytes, past the chunk: those bytes never reach a code that meets a nonzero input. Only near
 * the end of the codes buffer (`end`, NULL when the caller knows it is far) the load is masked;
 * deciding that per block rather than per load keeps a branch out of the inner loop (measured much
 * faster at 3 bits: benchmarks/RESULTS.md). */
QL_INLINE QL_AVX512 __m512i ql_codes16(const int mode, const int B, const ql_weight *w, const ql_bits512 *bits,
                                       const uint8_t *group, int64_t c, const uint8_t *end) {
    const int64_t width = B ? B : w->bits;
    const uint8_t *src = group + c * width / 8;
    __m128i bytes = end == NULL || src + 16 <= end
                        ? _mm_loadu_si128((const __m128i *)src)
                        : _mm_maskz_loadu_epi8((__mmask16)((1u << (end - src)) - 1u), src);
    if (mode == QL_MODE_BYTE) return w->kind == QL_INT8 ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    __m512i spread = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(bytes), bits->shuffle);
    return _mm512_and_si512(_mm512_srlv_epi32(spread, bits->shift), bits->mask);
}

QL_INLINE QL_AVX512 __m512 ql_values16(const int use_table, __m512i codes, const ql_group512 *group) {
    if (use_table) return _mm512_permutexvar_ps(codes, group->table);
    return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(codes), group->zero), group->scale);
}

/* NR output features x R rows of x. In nibble mode a chunk is 32 codes: V = 2 vectors (even
 * and odd codes). One row alone keeps a separate accumulator per vector, so that FMA latency,
 * not throughput, does not limit it. B is the bit width when known at compile time. */
QL_INLINE QL_AVX512 void ql_block512(const int mode, const int use_table, const int B, const int NR, const int R,
                                     const int checked, const ql_weight *w, const ql_bits512 *bits,
                                     const ql_layout *layout, const float *xp, int64_t row_length, int64_t n0,
                                     float *y, int64_t y_stride, const float *params) {
    const int V = mode == QL_MODE_NIBBLE ? 2 : 1;
    const int A = R == 1 ? V : 1;
    const uint8_t *end = checked ? w->codes + w->n * w->groups * w->group_bytes : NULL;
    const int64_t G = w->groups;
    __m512 acc[4][4][2];
    for (int j = 0; j < NR; j++)
        for (int r = 0; r < R; r++)
            for (int a = 0; a < A; a++) acc[j][r][a] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *group[4];
        ql_group512 constants[4];
        for (int j = 0; j < NR; j++) {
            group[j] = w->codes + ((n0 + j) * G + g) * w->group_bytes;
            constants[j] = ql_group512_make(w, params[j * G + g], params[(4 + j) * G + g], use_table);
        }
        const float *xg = xp + g * layout->padded_group;
        for (int64_t c = 0; c < w->group_codes; c += 16 * V) {
            __m512 value[4][2];
            for (int j = 0; j < NR; j++) {
                if (mode == QL_MODE_NIBBLE) {
                    __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(group[j] + c / 2)));
                    value[j][0] = _mm512_permutexvar_ps(packed, constants[j].table);
                    value[j][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 4), constants[j].table);
                } else {
                    __m512i codes = ql_codes16(mode, B, w, bits, group[j], c, end);
                    value[j][0] = ql_values16(use_table, codes, &constants[j]);
                }
            }
            for (int r = 0; r < R; r++) {
                for (int v = 0; v < V; v++) {
                    __m512 xv = _mm512_loadu_ps(xg + r * row_length + c + 16 * v);
                    const int a = A == 1 ? 0 : v;
                    for (int j = 0; j < NR; j++) acc[j][r][a] = _mm512_fmadd_ps(value[j][v], xv, acc[j][r][a]);
                }
            }
        }
    }
    /* The 4 features' sums reduced together (ql_store_sums), not one horizontal sum each: faster at one
     * row on every shape measured (benchmarks/RESULTS.md). */
    for (int r = 0; r < R; r++) {
        __m512 sums[4];
        for (int j = 0; j < NR; j++) sums[j] = A == 2 ? _mm512_add_ps(acc[j][r][0], acc[j][r][1]) : acc[j][r][0];
        ql_store_sums(NR, sums, y + r * y_stride + n0);
    }
}

/* The 4 features of a block decoded into `decoded` (4 rows in the layout of x): for the panels
 * (ql_panels512), and below them, from QL_DECODE_ROWS rows, for odd widths, where every block of 4 rows
 * is then a plain float dot product (ql_dot4_512), the decoding paid once per feature instead of once
 * per block of rows. Measured there: 3-bit faster; 4-bit and 8-bit, whose decoding is cheap, slower
 * (the buffer and 4 rows of x no longer fit in L1), so they decode in registers (benchmarks/RESULTS.md). */
QL_INLINE QL_AVX512 void ql_decode4_512(const int mode, const int use_table, const int B, const ql_weight *w,
                                        const ql_bits512 *bits, const ql_layout *layout, int64_t n0,
                                        const float *params, float *decoded, int64_t row_length) {
    const uint8_t *end = w->codes + w->n * w->groups * w->group_bytes; /* rare path: keep the check */
    const int64_t G = w->groups;
    for (int j = 0; j < 4; j++) {
        float *row = decoded + j * row_length;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *group = w->codes + ((n0 + j) * G + g) * w->group_bytes;
            ql_group512 constants = ql_group512_make(w, params[j * G + g], params[(4 + j) * G + g], use_table);
            float *out = row + g * layout->padded_group;
            int64_t c = 0;
            if (mode == QL_MODE_NIBBLE) {
                for (; c < w->group_codes; c += 32) {
                    __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(group + c / 2)));
                    _mm512_storeu_ps(out + c, _mm512_permutexvar_ps(packed, constants.table));
                    _mm512_storeu_ps(out + c + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 4), constants.table));
                }
            } else {
                for (; c < w->group_codes; c += 16)
                    _mm512_storeu_ps(out + c, ql_values16(use_table, ql_codes16(mode, B, w, bits, group, c, end), &constants));
            }
            for (; c < layout->padded_group; c += 16) _mm512_storeu_ps(out + c, _mm512_setzero_ps());
        }
    }
}

QL_INLINE QL_AVX512 void ql_dot4_512(const int R, const float *decoded, const float *xp, int64_t row_length, int64_t n0,
                                     float *y, int64_t y_stride) {
    __m512 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < R; r++) acc[j][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < row_length; k += 16) {
        __m512 value[4];
        for (int j = 0; j < 4; j++) value[j] = _mm512_loadu_ps(decoded + j * row_length + k);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_loadu_ps(xp + r * row_length + k);
            for (int j = 0; j < 4; j++) acc[j][r] = _mm512_fmadd_ps(value[j], xv, acc[j][r]);
        }
    }
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < R; r++) y[r * y_stride + n0 + j] = _mm512_reduce_add_ps(acc[j][r]);
}

/* ---- many rows: panels of 32 decoded features ----------------------------------------------
 * From QL_AVX512_PANEL_ROWS rows on, features go in panels of 32: each feature decoded once a call
 * (ql_decode4_512, the layout of x), the panel transposed input-major and multiplied by every row of
 * x, 8 rows at a time, in the outer-product form of BLAS kernels (ql_panel512): per input 2 weight
 * loads and 8 broadcasts of x for 16 FMAs, and no horizontal sums. Decoding in registers per block of
 * 4 rows (ql_block512) pays the decode once per 4 rows and 16 horizontal sums per block; the panel
 * is faster at many rows for every format (benchmarks/RESULTS.md). A pass covers QL_PANEL512_INPUTS
 * inputs, so that its part of the panel stays in L1 while the rows go by. */
#define QL_PANEL512_INPUTS 192

/* y[r, n0..n0+31] (added to its value so far unless k0 is 0) for R rows (at most 8) of x times a panel
 * of 32 decoded features (panel[k * 32 + j]) over inputs [k0, k1). */
QL_INLINE QL_AVX512 void ql_panel512(const int R, const float *panel, int64_t k0, int64_t k1, const float *xr,
                                     int64_t x_stride, int64_t n0, float *yr, int64_t y_stride) {
    __m512 acc[8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k++) {
        const __m512 w0 = _mm512_loadu_ps(panel + k * 32), w1 = _mm512_loadu_ps(panel + k * 32 + 16);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(xr[r * x_stride + k]);
            acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *out = yr + r * y_stride + n0;
        if (k0) {
            acc[r][0] = _mm512_add_ps(_mm512_loadu_ps(out), acc[r][0]);
            acc[r][1] = _mm512_add_ps(_mm512_loadu_ps(out + 16), acc[r][1]);
        }
        _mm512_storeu_ps(out, acc[r][0]);
        _mm512_storeu_ps(out + 16, acc[r][1]);
    }
}

/* Features [n, n1) in whole panels of 32 for m rows; returns the first feature left over (fewer than
 * 32). `decoded` holds QL_AVX512_PANEL_FLOATS(row_length) floats. */
QL_INLINE QL_AVX512 int64_t ql_panels512(const int mode, const int use_table, const int B, const ql_weight *w,
                                         const ql_bits512 *bits, const ql_layout *layout, const float *xp,
                                         int64_t m, int64_t n, int64_t n1, float *y, int64_t y_stride,
                                         float *params, float *decoded) {
    const int64_t row_length = w->groups * layout->padded_group;
    const int64_t passes = (row_length + QL_PANEL512_INPUTS - 1) / QL_PANEL512_INPUTS;
    const int64_t pass = ql_round_up((row_length + passes - 1) / passes, 8); /* equal passes */
    float *panel = decoded + 32 * row_length;
    for (; n + 32 <= n1; n += 32) {
        for (int64_t j = 0; j < 32; j += 4) {
            ql_params4_512(w, n + j, params);
            ql_decode4_512(mode, use_table, B, w, bits, layout, n + j, params, decoded + j * row_length, row_length);
        }
        for (int64_t k = 0; k < row_length; k += 8)
            for (int64_t j = 0; j < 32; j += 8)
                ql_transpose8x8(decoded + j * row_length + k, row_length, panel + k * 32 + j, 32);
        for (int64_t k0 = 0; k0 < row_length; k0 += pass) {
            const int64_t k1 = row_length - k0 <= pass ? row_length : k0 + pass;
            int64_t r = 0;
            for (; r + 8 <= m; r += 8) ql_panel512(8, panel, k0, k1, xp + r * row_length, row_length, n, y + r * y_stride, y_stride);
            const float *xr = xp + r * row_length;
            float *yr = y + r * y_stride;
            switch (m - r) {
            case 7: ql_panel512(7, panel, k0, k1, xr, row_length, n, yr, y_stride); break;
            case 6: ql_panel512(6, panel, k0, k1, xr, row_length, n, yr, y_stride); break;
            case 5: ql_panel512(5, panel, k0, k1, xr, row_length, n, yr, y_stride); break;
            case 4: ql_panel512(4, panel, k0, k1, xr, row_length, n, yr, y_stride); break;
            case 3: ql_panel512(3, panel, k0, k1, xr, row_length, n, yr, y_stride); break;
            case 2: ql_panel512(2, panel, k0, k1, xr, row_length, n, yr, y_stride); break;
            case 1: ql_panel512(1, panel, k0, k1, xr, row_length, n, yr, y_stride); break;
            default: break;
            }
        }
    }
    return n;
}

/* Features in blocks of 4, and for each, rows in blocks of 4, 2, 1: a block's codes are read
 * from memory once and stay in cache while every block of rows uses them. */

/* One block of 4 features, every row. */
QL_INLINE QL_AVX512 void ql_rows512(const int mode, const int use_table, const int B, const int checked,
                                    const ql_weight *w, const ql_bits512 *bits, const ql_layout *layout,
                                    const float *xp, int64_t row_length, int64_t m, int64_t n, float *y,
                                    int64_t y_stride, const float *params) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4)
        ql_block512(mode, use_table, B, 4, 4, checked, w, bits, layout, xp + r * row_length, row_length, n,
                    y + r * y_stride, y_stride, params);
    for (; r + 2 <= m; r += 2)
        ql_block512(mode, use_table, B, 4, 2, checked, w, bits, layout, xp + r * row_length, row_length, n,
                    y + r * y_stride, y_stride, params);
    for (; r < m; r++)
        ql_block512(mode, use_table, B, 4, 1, checked, w, bits, layout, xp + r * row_length, row_length, n,
                    y + r * y_stride, y_stride, params);
}

/* Features in blocks of 4, and for each, rows in blocks of 4, 2, 1: a block's codes are read
 * from memory once and stay in cache while every block of rows uses them. */
QL_INLINE QL_AVX512 void ql_gemm512_mode(const int mode, const int use_table, const int B, const ql_weight *w,
                                         const ql_bits512 *bits, const ql_layout *layout, const float *xp, int64_t m,
                                         int64_t n0, int64_t n1, float *y, int64_t y_stride, float *params,
                                         float *decoded) {
    int64_t row_length = w->groups * layout->padded_group, G = w->groups;
    const uint8_t *end = w->codes + w->n * G * w->group_bytes;
    int64_t n = n0;
    if (m >= QL_AVX512_PANEL_ROWS) n = ql_panels512(mode, use_table, B, w, bits, layout, xp, m, n, n1, y, y_stride, params, decoded);
    for (; n + 4 <= n1; n += 4) {
        ql_params4_512(w, n, params);
        if (mode == QL_MODE_BITS && m >= QL_DECODE_ROWS) {
            ql_decode4_512(mode, use_table, B, w, bits, layout, n, params, decoded, row_length);
            int64_t r = 0;
            for (; r + 4 <= m; r += 4)
                ql_dot4_512(4, decoded, xp + r * row_length, row_length, n, y + r * y_stride, y_stride);
            for (; r < m; r++) ql_dot4_512(1, decoded, xp + r * row_length, row_length, n, y + r * y_stride, y_stride);
        } else if (mode != QL_MODE_NIBBLE && w->codes + (n + 4) * G * w->group_bytes + 16 > end) {
            ql_rows512(mode, use_table, B, 1, w, bits, layout, xp, row_length, m, n, y, y_stride, params);
        } else {
            ql_rows512(mode, use_table, B, 0, w, bits, layout, xp, row_length, m, n, y, y_stride, params);
        }
    }
    for (; n < n1; n++) {
        ql_params512(w, n, params, params + 4 * G); /* the layout of ql_params4_512, feature 0 */
        for (int64_t r = 0; r < m; r++)
            ql_block512(mode, use_table, B, 1, 1, mode != QL_MODE_NIBBLE, w, bits, layout, xp + r * row_length,
                        row_length, n, y + r * y_stride, y_stride, params);
    }
}

int ql_mode512(const ql_weight *w) {
    if (w->bits == 4 && w->kind != QL_INT8 && w->group_codes % 32 == 0) return QL_MODE_NIBBLE;
    if (w->bits == 8) return QL_MODE_BYTE;
    return QL_MODE_BITS;
}

QL_AVX512 void ql_gemm512(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t m, int64_t n0,
                                 int64_t n1, float *y, int64_t y_stride, float *params, float *decoded) {
    ql_bits512 bits = ql_bits512_make(w->bits);
    switch (ql_mode512(w) == QL_MODE_BITS ? w->bits : -ql_mode512(w)) {
    case -QL_MODE_NIBBLE:
        ql_gemm512_mode(QL_MODE_NIBBLE, 1, 4, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    case -QL_MODE_BYTE:
        ql_gemm512_mode(QL_MODE_BYTE, 0, 8, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    case 2:
        ql_gemm512_mode(QL_MODE_BITS, 1, 2, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    case 3:
        ql_gemm512_mode(QL_MODE_BITS, 1, 3, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    case 4:
        ql_gemm512_mode(QL_MODE_BITS, 1, 4, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
        break;
    default:
        ql_gemm512_mode(QL_MODE_BITS, 0, 0, w, &bits, layout, xp, m, n0, n1, y, y_stride, params, decoded);
    }
}

QL_INLINE QL_AVX512 void ql_dequantize512_mode(const int mode, const int use_table, const ql_weight *w,
                                               const ql_bits512 *bits, int64_t n0, int64_t n1, float *out,
                                               int64_t out_stride, float *params) {
    const uint8_t *end = w->codes + w->n * w->groups * w->group_bytes;
    for (int64_t n = n0; n < n1; n++) {
        float *row = out + (n - n0) * out_stride;
        ql_params512(w, n, params, params + w->groups);
        for (int64_t g = 0; g < w->groups; g++) {
            int64_t index = n * w->groups + g, first = g * w->group_size;
            int64_t valid = w->group_size < w->k - first ? w->group_size : w->k - first;
            const uint8_t *group = w->codes + index * w->group_bytes;
            ql_group512 constants = ql_group512_make(w, params[g], params[w->groups + g], use_table);
            for (int64_t c = 0; c < valid; c += 16) {
                __m512 value = ql_values16(use_table, ql_codes16(mode, 0, w, bits, group, c, end), &constants);
                int64_t left = valid - c;
                if (left >= 16)
                    _mm512_storeu_ps(row + first + c, value);
                else
                    _mm512_mask_storeu_ps(row + first + c, (__mmask16)((1u << left) - 1u), value);
            }
        }
    }
}

QL_AVX512 void ql_dequantize512(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride,
                                       float *params) {
    ql_bits512 bits = ql_bits512_make(w->bits);
    if (w->bits == 8)
        ql_dequantize512_mode(QL_MODE_BYTE, 0, w, &bits, n0, n1, out, out_stride, params);
    else if (w->bits <= 4)
        ql_dequantize512_mode(QL_MODE_BITS, 1, w, &bits, n0, n1, out, out_stride, params);
    else
        ql_dequantize512_mode(QL_MODE_BITS, 0, w, &bits, n0, n1, out, out_stride, params);
}

#endif
