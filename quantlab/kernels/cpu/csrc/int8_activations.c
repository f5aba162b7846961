/* Int8 activations for 4-bit affine and int8 weights: the compiled decode step's option
 * `int8_activations` (quantlab.generation). x is quantized per block of 64 inputs to int8 with one
 * float scale (d = max|x| / 127, as llama.cpp's Q8_0 does per 32), and each block's dot product with
 * the codes is exact in int32, then scaled:
 *
 *     4-bit affine: y[n] = sum_b scale[g(b)] * d[b] * (sum_k q[k] * xq[k] - zero[g(b)] * sum_k xq[k])
 *     int8:         y[n] = sum_b scale[g(b)] * d[b] * sum_k q[k] * xq[k]
 *
 * That reads a 64-weight block with a fraction of the instructions of decoding it to floats, which is
 * what one row (decoding) is bound by. It is not bit-exact: x is rounded to 8 bits (the relative error
 * of a dot product is in benchmarks/RESULTS.md), so it is an option, never the default.
 * Two one-row kernels: avx512_vnni.c (vpdpbusd) and avx2_int8.c (vpmaddubsw + vpmaddwd, llama.cpp's
 * AVX2 scheme); at many rows (a prompt) the arithmetic is the bound, and avx512_vnni_rows.c and
 * avx2_int8_rows.c repack panels of features once a call so that lanes run across features and the
 * float epilogue is paid once per block. This file chooses the instruction set and holds what they share. */
#include "quantlab_cpu.h"

/* The int8-activation kernel of this CPU (at the instruction set ql_isa allows). */
int ql_a8_kernel(void) {
#ifdef QL_X86
    __builtin_cpu_init();
    const int isa = ql_isa();
    if (isa == QL_ISA_AVX512 && __builtin_cpu_supports("avx512vnni")) return QL_A8_VNNI;
    if (isa >= QL_ISA_AVX2) return QL_A8_AVX2;
#endif
    return QL_A8_NONE;
}

/* 1 when this CPU runs an int8-activation kernel, else 0. */
QL_API int ql_has_int8_activations(void) { return ql_a8_kernel() != QL_A8_NONE; }

/* 4-bit affine codes (nibble layout) or int8 codes (byte layout), in groups of whole blocks of 64. */
int ql_a8_eligible(const ql_weight *w) {
    if (w->group_codes % 64) return 0;
    return (w->kind == QL_AFFINE && w->bits == 4) || w->kind == QL_INT8;
}

/* xz[g] = sum over group g's blocks of d[b] * sum(xq of block b): the zero point's factor per group. */
void ql_zero_terms(const ql_weight *w, const float *xd, const int32_t *xs, float *xz) {
    const int64_t per_group = w->group_codes / 64;
    for (int64_t g = 0; g < w->groups; g++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < per_group; i++) sum += xd[g * per_group + i] * (float)xs[g * per_group + i];
        xz[g] = sum;
    }
}

/* One allocation, 64-byte aligned parts: xz [m, groups], then scales and shares [groups, panel], the panel's
 * scales and zeros as stored [panel, groups] each, then its codes [groups x group_codes, panel] as bytes. */
int ql_a8_scratch_make(const ql_weight *w, int64_t m, int64_t panel, ql_a8_scratch *scratch) {
    const int64_t xz = ql_round_up(m * w->groups, 16), params = ql_round_up(w->groups * panel, 16);
    const int64_t codes = w->groups * w->group_codes * panel, padded = QL_AMX_STEP_ROWS * w->groups * w->group_codes;
    float *base = NULL;
    if (posix_memalign((void **)&base, 64, (size_t)((xz + 4 * params) * (int64_t)sizeof(float) + codes + padded))) return 1;
    scratch->xz = base;
    scratch->scales = base + xz;
    scratch->shares = scratch->scales + params;
    scratch->stored = scratch->shares + params;
    scratch->panel = (uint8_t *)(scratch->stored + 2 * params);
    scratch->padded = (int8_t *)(scratch->panel + codes);
    return 0;
}

static int ql_rows_choice = QL_ROWS_ISA;

/* Turn the AMX kernel on (QL_ROWS_AMX: only where ql_amx_status is ready and the VNNI kernel runs), the
 * emulated one (x86), or back to the instruction set's (QL_ROWS_ISA). */
QL_API int ql_set_a8_rows(int choice) {
#ifdef QL_X86
    if (choice == QL_ROWS_AMX && (ql_amx_status() != QL_AMX_READY || ql_a8_kernel() != QL_A8_VNNI)) return 1;
    if (choice == QL_ROWS_ISA || choice == QL_ROWS_AMX || choice == QL_ROWS_AMX_EMULATED) {
        ql_rows_choice = choice;
        return 0;
    }
#endif
    return choice == QL_ROWS_ISA ? 0 : 1;
}

QL_API int ql_a8_rows_choice(void) { return ql_rows_choice; }

#ifdef QL_X86
/* The many-row kernel of int8-activation kernel a8 on m rows. */
ql_a8_rows_kernel ql_a8_rows_for(int a8, int64_t m) {
    if (ql_rows_choice == QL_ROWS_AMX_EMULATED) return ql_rows_amx_emulated_a8;
    if (ql_rows_choice == QL_ROWS_AMX && a8 == QL_A8_VNNI && m >= QL_AMX_ROWS) return ql_rows_amx_a8;
    return a8 == QL_A8_VNNI ? ql_rows512_a8 : ql_rows256_a8;
}

#endif

/* The panel of features that kernel repacks: 16 (AVX2) or 32. */
int64_t ql_a8_rows_panel(int a8, int64_t m) {
#ifdef QL_X86
    return ql_a8_rows_for(a8, m) == ql_rows256_a8 ? 16 : 32;
#else
    (void)a8, (void)m;
    return 16;
#endif
}

#ifdef QL_X86
/* Features [n, n + count) of a panel of `panel` features: scales[g * panel + f] and, for affine weights,
 * shares[g * panel + f] = scale * zero, the product the one-row kernels take off; zeros past count. The
 * stored scales and zeros convert a feature's row at a time (ql_params256), then go across. */
void ql_panel_params(const ql_weight *w, int64_t n, int64_t count, int64_t panel, const ql_a8_scratch *scratch) {
    const int64_t G = w->groups;
    float *scale = scratch->stored, *zero = scratch->stored + count * G;
    ql_params256(w, n, (int)count, scale, zero);
    for (int64_t g = 0; g < G; g++) {
        float *scales = scratch->scales + g * panel, *shares = scratch->shares + g * panel;
        for (int64_t f = 0; f < count; f++) {
            scales[f] = scale[f * G + g];
            shares[f] = scale[f * G + g] * zero[f * G + g];
        }
        for (int64_t f = count; f < panel; f++) scales[f] = shares[f] = 0.0f;
    }
}
#endif
