/* The portable kernels: any CPU, any compiler; also the reference for the vector paths' tests. */
#include "quantlab_cpu.h"

/* Scale and zero of every group of feature n (the per-group work hoisted out of the inner loops). */
void ql_params_scalar(const ql_weight *w, int64_t n, float *scale, float *zero) {
    for (int64_t g = 0; g < w->groups; g++) {
        ql_group group = ql_group_at(w, n * w->groups + g);
        scale[g] = group.scale;
        zero[g] = group.zero;
    }
}

void ql_prepare_x(const ql_weight *w, const ql_layout *layout, const float *x, int64_t m, int64_t x_stride,
                         float *xp) {
    int64_t padded = layout->padded_group, row_length = w->groups * padded;
    for (int64_t r = 0; r < m; r++) {
        const float *src = x + r * x_stride;
        for (int64_t g = 0; g < w->groups; g++) {
            float *group = xp + r * row_length + g * padded;
            int64_t first = g * w->group_size;
            int64_t valid = w->group_size < w->k - first ? w->group_size : w->k - first;
            if (!layout->nibble) {
                memcpy(group, src + first, (size_t)valid * sizeof(float));
                memset(group + valid, 0, (size_t)(padded - valid) * sizeof(float));
                continue;
            }
            int64_t base = 0;
            for (; base + 32 <= valid; base += 32) { /* whole blocks: no bounds to check (vectorized) */
                const float *block = src + first + base;
                float *even = group + base, *odd = group + base + 16;
                for (int64_t i = 0; i < 16; i++) {
                    even[i] = block[2 * i];
                    odd[i] = block[2 * i + 1];
                }
            }
            for (; base < padded; base += 32) {
                for (int64_t i = 0; i < 16; i++) {
                    int64_t even = base + 2 * i, odd = even + 1;
                    group[base + i] = even < valid ? src[first + even] : 0.0f;
                    group[base + 16 + i] = odd < valid ? src[first + odd] : 0.0f;
                }
            }
        }
    }
}

/* ---- portable path -------------------------------------------------------------------------- */

static void ql_decode_group_scalar(const ql_weight *w, int64_t n, int64_t g, float *out) {
    int64_t index = n * w->groups + g;
    const uint8_t *codes = w->codes + index * w->group_bytes;
    ql_group group = ql_group_at(w, index);
    for (int64_t j = 0; j < w->group_codes; j++) out[j] = ql_base(w, ql_code_at(w, codes, j), group.zero) * group.scale;
}

void ql_gemm_scalar(const ql_weight *w, const ql_layout *layout, const float *xp, int64_t m, int64_t n0,
                           int64_t n1, float *y, int64_t y_stride, float *buffer) {
    int64_t row_length = w->groups * layout->padded_group;
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t r = 0; r < m; r++) y[r * y_stride + n] = 0.0f;
        for (int64_t g = 0; g < w->groups; g++) {
            ql_decode_group_scalar(w, n, g, buffer);
            for (int64_t r = 0; r < m; r++) {
                const float *xg = xp + r * row_length + g * layout->padded_group;
                float sum = 0.0f;
                for (int64_t j = 0; j < w->group_codes; j++) sum += buffer[j] * xg[j];
                y[r * y_stride + n] += sum;
            }
        }
    }
}

void ql_dequantize_scalar(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride,
                                 float *buffer) {
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t g = 0; g < w->groups; g++) {
            ql_decode_group_scalar(w, n, g, buffer);
            int64_t first = g * w->group_size, count = w->group_size;
            if (first + count > w->k) count = w->k - first;
            memcpy(out + (n - n0) * out_stride + first, buffer, (size_t)count * sizeof(float));
        }
    }
}
