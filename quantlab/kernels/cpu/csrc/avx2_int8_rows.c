/* The many-row int8-activation kernel for AVX2 (a prompt's prefill; the scheme: int8_activations.c),
 * laid out as avx512_vnni_rows.c is: a thread repacks each panel of 16 features' codes once into bytes
 * [k / 4][16 features][4 codes], so one 32-byte load holds 8 features x 4 inputs and each row's 4 int8
 * inputs are one broadcast; a step multiplies QL_TILE_ROWS rows x 16 features.
 *   4-bit: vpmaddubsw (codes 0..15 unsigned x xq signed) gives int16 sums of pairs of at most
 *   2 * 15 * 127 = 3810, so 8 steps add up in int16 (at most 30480) before one vpmaddwd with ones.
 *   int8: vpmaddubsw on |q| and xq with q's sign, pairs of at most 2 * 128 * 127 = 32512: each goes to
 *   int32 at once (two would overflow int16).
 * Each block's int32 dot product is exact; the float epilogue (cvt, then fma with scale * d) is paid once
 * per block of 64 inputs and (row, 8 features). */
#include "quantlab_cpu.h"
#include "transpose8x8.h"

#ifdef QL_X86
#define QL_PANEL 16    /* features a panel: two vectors of 8 */
#define QL_TILE_ROWS 4 /* rows a step: 8 int16 sums, 2 code vectors and a broadcast stay in registers */

/* Codes of features [n, n + count) into a panel of `panel` features (16 here, 32 for avx512_vnni_rows.c):
 * step s = b * 16 + t (inputs 4t..4t+3 of block b) holds the panel's features x 4 codes as bytes, 4-bit
 * codes 0..15, int8 codes as stored (signed), or offset to unsigned (q ^ 0x80, `offset`); features past
 * count are zeros. 8 whole features go as 8 x 8 transposes of 4-byte words (one word: 4 int8 codes, or the
 * 8 codes of two 4-bit steps, whose nibbles byte unpacks interleave, low first); a last partial 8 byte by byte. */
QL_AVX2 void ql_repack_a8(const ql_weight *w, int64_t n, int64_t count, int64_t panel, int offset, uint8_t *out) {
    const int64_t blocks = w->groups * w->group_codes / 64, row_bytes = w->groups * w->group_bytes;
    const int64_t step = 4 * panel, block_bytes = w->kind == QL_INT8 ? 64 : 32;
    const __m256i low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8(offset ? (char)0x80 : 0);
    for (int64_t f0 = 0; f0 < panel; f0 += 8) {
        const int64_t valid = count - f0;
        const uint8_t *codes = w->codes + (n + f0) * row_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *dst = out + b * 16 * step + 4 * f0;
            if (valid < 8) {
                for (int f = 0; f < 8; f++)
                    for (int t = 0; t < 16; t++) {
                        uint8_t *quad = dst + t * step + 4 * f;
                        const uint8_t *src = codes + f * row_bytes + b * block_bytes;
                        for (int i = 0; i < 4; i++)
                            quad[i] = f >= valid            ? 0
                                      : w->kind == QL_INT8 ? (uint8_t)(src[4 * t + i] ^ (offset ? 0x80 : 0))
                                                           : (uint8_t)((src[2 * t + i / 2] >> (4 * (i % 2))) & 0x0f);
                    }
                continue;
            }
            for (int64_t half = 0; half < block_bytes; half += 32) {
                float words[8][8]; /* words[u][f]: word u of the half block of feature f0 + f */
                ql_transpose8x8((const float *)(codes + b * block_bytes + half), row_bytes / 4, &words[0][0], 8);
                for (int u = 0; u < 8; u++) {
                    const __m256i word = _mm256_castps_si256(_mm256_loadu_ps(words[u]));
                    if (w->kind == QL_INT8) {
                        _mm256_storeu_si256((__m256i *)(dst + (half / 4 + u) * step), _mm256_xor_si256(word, flip));
                        continue;
                    }
                    const __m256i lo = _mm256_and_si256(word, low), hi = _mm256_and_si256(_mm256_srli_epi16(word, 4), low);
                    /* per 128 bits: features f, f + 1 as [codes 0-3, codes 4-7] each, then f + 2, f + 3 */
                    const __m256 a = _mm256_castsi256_ps(_mm256_unpacklo_epi8(lo, hi));
                    const __m256 c = _mm256_castsi256_ps(_mm256_unpackhi_epi8(lo, hi));
                    _mm256_storeu_si256((__m256i *)(dst + (2 * u) * step), _mm256_castps_si256(_mm256_shuffle_ps(a, c, 0x88)));
                    _mm256_storeu_si256((__m256i *)(dst + (2 * u + 1) * step), _mm256_castps_si256(_mm256_shuffle_ps(a, c, 0xdd)));
                }
            }
        }
    }
}

/* The int32 dot products of one block of 64 inputs: R rows x 16 features. */
QL_INLINE QL_AVX2 void ql_block256_rows(const int R, const int int8, const uint8_t *step, const int8_t *x,
                                        int64_t row_length, __m256i dot[][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    if (int8) {
        for (int t = 0; t < 16; t++) {
            const __m256i c0 = _mm256_load_si256((const __m256i *)(step + t * 4 * QL_PANEL));
            const __m256i c1 = _mm256_load_si256((const __m256i *)(step + t * 4 * QL_PANEL + 32));
            const __m256i a0 = _mm256_abs_epi8(c0), a1 = _mm256_abs_epi8(c1);
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, x + r * row_length + 4 * t, 4);
                const __m256i v = _mm256_set1_epi32(four);
                dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(v, c0)), ones));
                dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(v, c1)), ones));
            }
        }
        return;
    }
    for (int half = 0; half < 16; half += 8) {
        __m256i pairs[QL_TILE_ROWS][2];
        for (int r = 0; r < R; r++) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
        for (int t = half; t < half + 8; t++) {
            const __m256i c0 = _mm256_load_si256((const __m256i *)(step + t * 4 * QL_PANEL));
            const __m256i c1 = _mm256_load_si256((const __m256i *)(step + t * 4 * QL_PANEL + 32));
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, x + r * row_length + 4 * t, 4);
                const __m256i v = _mm256_set1_epi32(four);
                pairs[r][0] = _mm256_add_epi16(pairs[r][0], _mm256_maddubs_epi16(c0, v));
                pairs[r][1] = _mm256_add_epi16(pairs[r][1], _mm256_maddubs_epi16(c1, v));
            }
        }
        for (int r = 0; r < R; r++) {
            dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(pairs[r][0], ones));
            dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(pairs[r][1], ones));
        }
    }
}

/* R rows x 16 features, as ql_tile512_a8 (avx512_vnni_rows.c) computes them. */
QL_INLINE QL_AVX2 void ql_tile256_a8(const int R, const int int8, const uint8_t *panel, const float *scales,
                                     const float *shares, const int8_t *xq, const float *xd, const float *xz,
                                     int64_t G, int64_t per_group, int64_t blocks, float *y, int64_t y_stride,
                                     int64_t count) {
    const int64_t row_length = blocks * 64;
    __m256 acc[QL_TILE_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0, g = 0, in_group = 0; b < blocks; b++, in_group++) {
        if (in_group == per_group) {
            in_group = 0;
            g++;
        }
        __m256i dot[QL_TILE_ROWS][2];
        ql_block256_rows(R, int8, panel + b * 16 * 4 * QL_PANEL, xq + b * 64, row_length, dot);
        const __m256 s0 = _mm256_load_ps(scales + g * QL_PANEL), s1 = _mm256_load_ps(scales + g * QL_PANEL + 8);
        for (int r = 0; r < R; r++) {
            const __m256 d = _mm256_set1_ps(xd[r * blocks + b]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), _mm256_mul_ps(s0, d), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][1]), _mm256_mul_ps(s1, d), acc[r][1]);
        }
    }
    if (!int8)
        for (int64_t g = 0; g < G; g++) {
            const __m256 z0 = _mm256_load_ps(shares + g * QL_PANEL), z1 = _mm256_load_ps(shares + g * QL_PANEL + 8);
            for (int r = 0; r < R; r++) {
                const __m256 xzr = _mm256_set1_ps(xz[r * G + g]);
                acc[r][0] = _mm256_fnmadd_ps(z0, xzr, acc[r][0]);
                acc[r][1] = _mm256_fnmadd_ps(z1, xzr, acc[r][1]);
            }
        }
    for (int r = 0; r < R; r++) {
        if (count == QL_PANEL) {
            _mm256_storeu_ps(y + r * y_stride, acc[r][0]);
            _mm256_storeu_ps(y + r * y_stride + 8, acc[r][1]);
            continue;
        }
        float out[QL_PANEL];
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        memcpy(y + r * y_stride, out, (size_t)count * sizeof(float));
    }
}

QL_INLINE QL_AVX2 void ql_rows256_a8_mode(const int int8, const ql_weight *w, const int8_t *xq, const float *xd,
                                          const int32_t *xs, int64_t m, int64_t n0, int64_t n1, float *y,
                                          int64_t y_stride, const ql_a8_scratch *s) {
    const int64_t G = w->groups, per_group = w->group_codes / 64, blocks = G * per_group, row_length = blocks * 64;
    if (!int8)
        for (int64_t r = 0; r < m; r++) ql_zero_terms(w, xd + r * blocks, xs + r * blocks, s->xz + r * G);
    for (int64_t n = n0; n < n1; n += QL_PANEL) {
        const int64_t count = n1 - n < QL_PANEL ? n1 - n : QL_PANEL;
        ql_repack_a8(w, n, count, QL_PANEL, 0, s->panel);
        ql_panel_params(w, n, count, QL_PANEL, s);
        int64_t r = 0;
        for (; r + QL_TILE_ROWS <= m; r += QL_TILE_ROWS)
            ql_tile256_a8(QL_TILE_ROWS, int8, s->panel, s->scales, s->shares, xq + r * row_length, xd + r * blocks,
                          s->xz + r * G, G, per_group, blocks, y + r * y_stride + n, y_stride, count);
        const int64_t rest = m - r;
#define QL_REST(R)                                                                                                     \
    ql_tile256_a8(R, int8, s->panel, s->scales, s->shares, xq + r * row_length, xd + r * blocks, s->xz + r * G, G,      \
                  per_group, blocks, y + r * y_stride + n, y_stride, count)
        if (rest == 3) QL_REST(3);
        if (rest == 2) QL_REST(2);
        if (rest == 1) QL_REST(1);
#undef QL_REST
    }
}

/* y[r, n] for features [n0, n1) and every row, as ql_rows512_a8 computes them; x rounded by
 * ql_quantize_x_a8_256 in its natural order. */
QL_AVX2 void ql_rows256_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m,
                           int64_t n0, int64_t n1, float *y, int64_t y_stride, const ql_a8_scratch *scratch) {
    if (w->kind == QL_INT8)
        ql_rows256_a8_mode(1, w, xq, xd, xs, m, n0, n1, y, y_stride, scratch);
    else
        ql_rows256_a8_mode(0, w, xq, xd, xs, m, n0, n1, y, y_stride, scratch);
}
#endif
