/* The many-row int8-activation kernel for AVX512-VNNI (a prompt's prefill; the scheme:
 * int8_activations.c). Lanes run across features: a thread repacks each panel of 32 features' codes
 * once into bytes laid out [k / 4][32 features][4 codes] (4-bit: codes 0..15; int8: q + 128, the offset
 * taken off exactly as 128 * sum xq of the block), so one 64-byte load holds 16 features x 4 inputs and
 * each row's 4 int8 inputs are one broadcast. A step multiplies QL_TILE_ROWS rows x 32 features with
 * vpdpbusd into int32 sums over a block of 64 inputs; the float epilogue (cvt, then fma with
 * scale * d) is paid once per block and (row, 16 features). x is rounded as the one-row kernel rounds it
 * (the same int8 values, blocks and scales), in its natural order. */
#include "quantlab_cpu.h"

#ifdef QL_X86
#define QL_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))
#define QL_PANEL 32     /* features a panel: two vectors of 16 */
#define QL_TILE_ROWS 6  /* rows a step: 12 int32 + 12 float accumulators, 2 code vectors, 1 broadcast */

/* R rows x 32 features: y[r, f] = sum_b scale[g(b), f] * d[r, b] * (q . xq)_b, minus the zero point's
 * share sum_g scale * zero * xz[r, g] (affine), stored for the first `count` features. */
QL_INLINE QL_VNNI void ql_tile512_a8(const int R, const int int8, const uint8_t *panel, const float *scales,
                                     const float *shares, const int8_t *xq, const float *xd, const int32_t *xs,
                                     const float *xz, int64_t G, int64_t per_group, int64_t blocks, float *y,
                                     int64_t y_stride, int64_t count) {
    const int64_t row_length = blocks * 64;
    __m512 acc[QL_TILE_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0, g = 0, in_group = 0; b < blocks; b++, in_group++) {
        if (in_group == per_group) {
            in_group = 0;
            g++;
        }
        __m512i dot[QL_TILE_ROWS][2];
        for (int r = 0; r < R; r++)
            dot[r][0] = dot[r][1] = int8 ? _mm512_set1_epi32(-128 * xs[r * blocks + b]) : _mm512_setzero_si512();
        const uint8_t *step = panel + b * 16 * 4 * QL_PANEL;
        const int8_t *x = xq + b * 64;
        for (int t = 0; t < 16; t++) {
            const __m512i c0 = _mm512_load_si512(step + t * 4 * QL_PANEL);
            const __m512i c1 = _mm512_load_si512(step + t * 4 * QL_PANEL + 64);
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, x + r * row_length + 4 * t, 4);
                const __m512i v = _mm512_set1_epi32(four);
                dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], c0, v);
                dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], c1, v);
            }
        }
        const __m512 s0 = _mm512_load_ps(scales + g * QL_PANEL), s1 = _mm512_load_ps(scales + g * QL_PANEL + 16);
        for (int r = 0; r < R; r++) {
            const __m512 d = _mm512_set1_ps(xd[r * blocks + b]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_mul_ps(s0, d), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][1]), _mm512_mul_ps(s1, d), acc[r][1]);
        }
    }
    if (!int8)
        for (int64_t g = 0; g < G; g++) {
            const __m512 z0 = _mm512_load_ps(shares + g * QL_PANEL), z1 = _mm512_load_ps(shares + g * QL_PANEL + 16);
            for (int r = 0; r < R; r++) {
                const __m512 xzr = _mm512_set1_ps(xz[r * G + g]);
                acc[r][0] = _mm512_fnmadd_ps(z0, xzr, acc[r][0]);
                acc[r][1] = _mm512_fnmadd_ps(z1, xzr, acc[r][1]);
            }
        }
    const __mmask16 m0 = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
    const __mmask16 m1 = count >= 32 ? (__mmask16)0xffff : count <= 16 ? 0 : (__mmask16)((1u << (count - 16)) - 1u);
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(y + r * y_stride, m0, acc[r][0]);
        _mm512_mask_storeu_ps(y + r * y_stride + 16, m1, acc[r][1]);
    }
}

QL_INLINE QL_VNNI void ql_rows512_a8_mode(const int int8, const ql_weight *w, const int8_t *xq, const float *xd,
                                          const int32_t *xs, int64_t m, int64_t n0, int64_t n1, float *y,
                                          int64_t y_stride, const ql_a8_scratch *s) {
    const int64_t G = w->groups, per_group = w->group_codes / 64, blocks = G * per_group, row_length = blocks * 64;
    if (!int8)
        for (int64_t r = 0; r < m; r++) ql_zero_terms(w, xd + r * blocks, xs + r * blocks, s->xz + r * G);
    for (int64_t n = n0; n < n1; n += QL_PANEL) {
        const int64_t count = n1 - n < QL_PANEL ? n1 - n : QL_PANEL;
        ql_repack_a8(w, n, count, QL_PANEL, 1, s->panel); /* avx2_int8_rows.c */
        ql_panel_params(w, n, count, QL_PANEL, s);
        int64_t r = 0;
        for (; r + QL_TILE_ROWS <= m; r += QL_TILE_ROWS)
            ql_tile512_a8(QL_TILE_ROWS, int8, s->panel, s->scales, s->shares, xq + r * row_length, xd + r * blocks,
                          xs + r * blocks, s->xz + r * G, G, per_group, blocks, y + r * y_stride + n, y_stride, count);
        const int64_t rest = m - r;
#define QL_REST(R)                                                                                                     \
    ql_tile512_a8(R, int8, s->panel, s->scales, s->shares, xq + r * row_length, xd + r * blocks, xs + r * blocks,      \
                  s->xz + r * G, G, per_group, blocks, y + r * y_stride + n, y_stride, count)
        if (rest == 5) QL_REST(5);
        if (rest == 4) QL_REST(4);
        if (rest == 3) QL_REST(3);
        if (rest == 2) QL_REST(2);
        if (rest == 1) QL_REST(1);
#undef QL_REST
    }
}

/* y[r, n] for features [n0, n1) and every row: the weight as `ql_a8_eligible` accepts it, x rounded by
 * ql_quantize_x_a8 in its natural order (row length: the weight's groups x group_codes). */
QL_VNNI void ql_rows512_a8(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m,
                           int64_t n0, int64_t n1, float *y, int64_t y_stride, const ql_a8_scratch *scratch) {
    if (w->kind == QL_INT8)
        ql_rows512_a8_mode(1, w, xq, xd, xs, m, n0, n1, y, y_stride, scratch);
    else
        ql_rows512_a8_mode(0, w, xq, xd, xs, m, n0, n1, y, y_stride, scratch);
}
#endif
