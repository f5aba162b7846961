/* The body of the many-row int8-activation kernel on AMX tiles, included twice by amx_int8_rows.c: once
 * with the tile instructions (QL_AMX_NAME ql_rows_amx_a8) and once with each tile instruction written
 * out in portable C (ql_rows_amx_emulated_a8), so the layout and repacking the hardware sees are the
 * ones the tests check on every CPU. The includer defines:
 *   QL_AMX_NAME, QL_AMX_TARGET            the function's name and its target attribute
 *   QL_TILES                              declarations the tile macros use (the emulated registers)
 *   QL_TILE_CONFIG(config), QL_TILE_RELEASE()
 *   QL_TILE_ZERO(t), QL_TILE_LOAD(t, base, stride), QL_TILE_STORE(t, base, stride)
 *   QL_TILE_DPBSUD(c, a, b)               c += a (signed bytes) . b (unsigned bytes), 4 at a time
 *
 * A step is 32 rows x 32 features over one block of 64 inputs: tiles 4 and 5 hold rows 0-15 and 16-31 of
 * x's int8 block (16 rows x 64 bytes), tiles 6 and 7 the panel's features 0-15 and 16-31 (16 rows of 4
 * inputs x 16 features x 4 codes: the panel avx512_vnni_rows.c repacks, read 128 bytes a row), and tiles
 * 0-3 their four int32 products. Those are stored, and the float epilogue avx512_vnni_rows.c runs per
 * block is run on them in the same order (cvt, fma with scale * d; the int8 offset taken off as
 * 128 * sum xq first), so every output equals ql_rows512_a8's bit for bit. A last partial step reads
 * x from a zero-padded copy and stores only its rows. */

QL_AMX_TARGET void QL_AMX_NAME(const ql_weight *w, const int8_t *xq, const float *xd, const int32_t *xs, int64_t m,
                               int64_t n0, int64_t n1, float *y, int64_t y_stride, const ql_a8_scratch *s) {
    const int int8 = w->kind == QL_INT8;
    const int64_t G = w->groups, per_group = w->group_codes / 64, blocks = G * per_group, row_length = blocks * 64;
    const int64_t tail = m % QL_AMX_STEP_ROWS, whole = m - tail;
    QL_TILES;
    ql_tile_config config;
    ql_amx_configure(&config);
    QL_TILE_CONFIG(&config);
    if (!int8)
        for (int64_t r = 0; r < m; r++) ql_zero_terms(w, xd + r * blocks, xs + r * blocks, s->xz + r * G);
    int8_t *padded = s->padded; /* the last partial step's rows of x, then zeros */
    if (tail) {
        memcpy(padded, xq + whole * row_length, (size_t)(tail * row_length));
        memset(padded + tail * row_length, 0, (size_t)((QL_AMX_STEP_ROWS - tail) * row_length));
    }
    int32_t sums[QL_AMX_STEP_ROWS * QL_AMX_PANEL] __attribute__((aligned(64)));
    float acc[QL_AMX_STEP_ROWS * QL_AMX_PANEL] __attribute__((aligned(64)));
    for (int64_t n = n0; n < n1; n += QL_AMX_PANEL) {
        const int64_t count = n1 - n < QL_AMX_PANEL ? n1 - n : QL_AMX_PANEL;
        ql_repack_a8(w, n, count, QL_AMX_PANEL, 1, s->panel); /* avx2_int8_rows.c */
        ql_panel_params(w, n, count, QL_AMX_PANEL, s);
        for (int64_t r0 = 0; r0 < m; r0 += QL_AMX_STEP_ROWS) {
            const int64_t rows = r0 < whole ? QL_AMX_STEP_ROWS : tail;
            const int8_t *x = r0 < whole ? xq + r0 * row_length : padded;
            memset(acc, 0, sizeof(acc));
            for (int64_t b = 0, g = 0, in_group = 0; b < blocks; b++, in_group++) {
                if (in_group == per_group) {
                    in_group = 0;
                    g++;
                }
                const uint8_t *codes = s->panel + b * 16 * 4 * QL_AMX_PANEL;
                QL_TILE_ZERO(0);
                QL_TILE_ZERO(1);
                QL_TILE_ZERO(2);
                QL_TILE_ZERO(3);
                QL_TILE_LOAD(4, x + b * 64, row_length);
                QL_TILE_LOAD(5, x + 16 * row_length + b * 64, row_length);
                QL_TILE_LOAD(6, codes, 4 * QL_AMX_PANEL);
                QL_TILE_LOAD(7, codes + 64, 4 * QL_AMX_PANEL);
                QL_TILE_DPBSUD(0, 4, 6);
                QL_TILE_DPBSUD(1, 4, 7);
                QL_TILE_DPBSUD(2, 5, 6);
                QL_TILE_DPBSUD(3, 5, 7);
                const int64_t row_bytes = QL_AMX_PANEL * (int64_t)sizeof(int32_t);
                QL_TILE_STORE(0, sums, row_bytes);
                QL_TILE_STORE(1, sums + 16, row_bytes);
                QL_TILE_STORE(2, sums + 16 * QL_AMX_PANEL, row_bytes);
                QL_TILE_STORE(3, sums + 16 * QL_AMX_PANEL + 16, row_bytes);
                const float *scales = s->scales + g * QL_AMX_PANEL;
                for (int64_t r = 0; r < rows; r++) {
                    const float d = xd[(r0 + r) * blocks + b];
                    const int32_t offset = int8 ? 128 * xs[(r0 + r) * blocks + b] : 0;
                    const int32_t *sum = sums + r * QL_AMX_PANEL;
                    float *out = acc + r * QL_AMX_PANEL;
                    for (int f = 0; f < QL_AMX_PANEL; f++) out[f] = fmaf((float)(sum[f] - offset), scales[f] * d, out[f]);
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                float *out = acc + r * QL_AMX_PANEL;
                if (!int8)
                    for (int64_t g = 0; g < G; g++) {
                        const float *shares = s->shares + g * QL_AMX_PANEL, xz = s->xz[(r0 + r) * G + g];
                        for (int f = 0; f < QL_AMX_PANEL; f++) out[f] = fmaf(-shares[f], xz, out[f]);
                    }
                memcpy(y + (r0 + r) * y_stride + n, out, (size_t)count * sizeof(float));
            }
        }
    }
    QL_TILE_RELEASE();
}
