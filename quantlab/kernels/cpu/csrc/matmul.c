/*
 * quantlab CPU kernels: fused dequantize + matrix multiply on quantlab's stored formats.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k], where w is decoded from the codes as stored in the
 * checkpoint (no repacked copy): int8 codes, 2..8-bit packed codes with a scale (and zero
 * point) per group, and NF4 codes with a plain or double-quantized absmax per block.
 *
 * At a few rows the work is reading the weights, so the codes are decoded in registers and
 * never written out as floats. Each decoded weight equals the reference dequantization bit
 * for bit (same operations in the same order: (q - zero) * scale, levels[q] * absmax), so
 * only the order of the float sums differs from dequantize-then-matmul.
 *
 * Plain C with x86 intrinsics in functions compiled for their instruction set
 * (`target` attributes) and chosen at run time, so one build runs on every x86-64 CPU;
 * other architectures get the portable C path. Threads come from a small pool of its own
 * (pool.c) rather than OpenMP, so a busy machine slows a call down to one thread's speed
 * instead of stalling it.
 *
 * Build (native.py does it): every .c file of this folder with -O3 -fPIC -pthread
 * -fvisibility=hidden -ffp-contract=off (which keeps a*b+c as two roundings, as torch
 * computes them), linked into one shared library.
 */
#include "quantlab_cpu.h"

#include <stdatomic.h>

/* ---- dispatch ---------------------------------------------------------------------------------- */

static int ql_forced_isa = -1;

static int ql_detect_isa(void) {
#ifdef QL_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq"))
        return QL_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return QL_ISA_AVX2;
#endif
    return QL_ISA_SCALAR;
}

/* The instruction set the kernels use: the best this CPU has, or a lower one forced for tests. */
QL_API int ql_isa(void) {
    int best = ql_detect_isa();
    return ql_forced_isa >= 0 && ql_forced_isa < best ? ql_forced_isa : best;
}

QL_API void ql_force_isa(int isa) { ql_forced_isa = isa; }

#define QL_AVX2_DECODE_ROWS 8 /* from this many rows on, AVX2 decodes the weights once a call (avx2.c) */

/* From how many rows on int8 activations take the many-row kernels (avx512_vnni_rows.c,
 * avx2_int8_rows.c: panels of features repacked once a call) instead of the one-row ones; the
 * crossover is measured for both (benchmarks/RESULTS.md). */
#define QL_A8_ROWS 4

static int ql_a8_rows(int a8, int64_t m) { return a8 != QL_A8_NONE && m >= QL_A8_ROWS; }

/* Whether a product on m rows takes AVX2's many-row kernel (float x; int8 activations have their own). */
static int ql_avx2_panels(int isa, int64_t m, int a8) {
    return isa == QL_ISA_AVX2 && m >= QL_AVX2_DECODE_ROWS && a8 == QL_A8_NONE;
}
/* ---- which product a call on many rows runs ---------------------------------------------------- */

/* A product of m >= 2 rows of float x runs either on the fused kernels here (QL_PRODUCT_FUSED; on an AVX-512
 * CPU, QL_PRODUCT_FUSED_AVX2 runs the AVX2 ones, whose panels of 16 features can share a layer of few
 * outputs better between threads) or as the weight decoded (ql_dequantize) and multiplied by the caller's
 * BLAS GEMM (QL_PRODUCT_DECODED: torch's, MKL or oneDNN). Which is faster depends on the CPU more than on
 * anything here: a vendor's BLAS may run its best code on one CPU and a weaker path on another. So it is
 * measured on the machine that runs it (quantlab.kernels.cpu.tune), per instruction set, format (kind and
 * bits), shape class and row bucket, and set here; an entry never set keeps the default: fused on x86,
 * decoded from 8 rows on with the portable kernel (it decodes each weight once per 4 rows). */
static signed char ql_products[3][QL_KINDS][9][QL_SHAPE_CLASSES][QL_ROW_BUCKETS]; /* 0: unset */

QL_API int ql_shape_class(int64_t n, int64_t k) { return n < QL_NARROW_OUTPUTS ? 0 : n * k < QL_LARGE_WEIGHT ? 1 : 2; }

QL_API int ql_row_bucket(int64_t m) {
    if (m < 2) return -1; /* one row: a pass over the weight, always fused */
    if (m < 16) return 0;
    if (m < 64) return 1;
    if (m < 256) return 2;
    return 3;
}

QL_API int ql_set_product(int isa, int kind, int bits, int shape_class, int row_bucket, int product) {
    if (isa < 0 || isa > QL_ISA_AVX512 || kind < 0 || kind >= QL_KINDS || bits < 2 || bits > 8 || shape_class < 0 ||
        shape_class >= QL_SHAPE_CLASSES || row_bucket < 0 || row_bucket >= QL_ROW_BUCKETS || product < 0 ||
        product > QL_PRODUCT_FUSED_AVX2 || (product == QL_PRODUCT_FUSED_AVX2 && isa != QL_ISA_AVX512))
        return QL_BAD_FORMAT;
    ql_products[isa][kind][bits][shape_class][row_bucket] = (signed char)product;
    return QL_OK;
}

/* The product of m rows on a weight of `kind` and `bits` with n outputs and k inputs (ql_product's table). */
static int ql_product_of(int kind, int bits, int64_t n, int64_t k, int64_t m) {
    int bucket = ql_row_bucket(m), isa = ql_isa();
    if (bucket < 0 || kind < 0 || kind >= QL_KINDS || bits < 2 || bits > 8) return QL_PRODUCT_FUSED;
    int chosen = ql_products[isa][kind][bits][ql_shape_class(n, k)][bucket];
    if (chosen != QL_PRODUCT_UNSET) return chosen;
    return isa == QL_ISA_SCALAR && m >= 8 ? QL_PRODUCT_DECODED : QL_PRODUCT_FUSED;
}

/* The instruction set a product of m rows of float x on features [0, features) of w's layout runs at: the
 * CPU's, or AVX2's kernels on an AVX-512 CPU where they were measured faster (QL_PRODUCT_FUSED_AVX2). */
int ql_product_isa(const ql_weight *w, int64_t m, int64_t features) {
    return ql_product_of(w->kind, w->bits, features, w->k, m) == QL_PRODUCT_FUSED_AVX2 ? QL_ISA_AVX2 : ql_isa();
}

QL_API int ql_product(const ql_weight *w, int64_t m) { return ql_product_of(w->kind, w->bits, w->n, w->k, m); }

QL_API int ql_abi_version(void) { return QL_ABI_VERSION; }

static int ql_check(const ql_weight *w) {
    if (w->bits < 2 || w->bits > 8 || w->groups < 1 || w->group_size < 1) return QL_BAD_FORMAT;
    if (w->kind == QL_INT8 && w->bits != 8) return QL_BAD_FORMAT;
    if (ql_table_kind(w) && (w->bits > 4 || (w->kind != QL_LUT && w->bits != 4))) return QL_BAD_FORMAT;
    if (w->kind != QL_INT8 && (w->group_codes % 8 || w->group_bytes != w->group_codes * w->bits / 8)) return QL_BAD_FORMAT;
    if (w->kind == QL_INT8 && w->group_bytes != w->group_codes) return QL_BAD_FORMAT;
    if (w->absmax_codes && (w->absmax_block < 16 || (w->absmax_block & (w->absmax_block - 1)))) return QL_BAD_FORMAT;
    if (w->group_codes < w->group_size || w->groups * w->group_size < w->k) return QL_BAD_FORMAT;
    return QL_OK;
}

/* How x is laid out for the kernels of `isa` on m rows (`a8`: int8 activations, which keep the layout
 * of one row). AVX2 at many rows decodes weights into the plain layout (ql_decode4_256). */
static ql_layout ql_layout_for(const ql_weight *w, int isa, int64_t m, int a8) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX512) return ql_make_layout(w, ql_mode512(w) == QL_MODE_NIBBLE ? 32 : 16, ql_mode512(w) == QL_MODE_NIBBLE);
    if (ql_avx2_panels(isa, m, a8)) return ql_make_layout(w, 8, 0);
    if (isa == QL_ISA_AVX2) /* 4-bit codes in chunks of 32: the nibble blocks of avx2.c */
        return ql_mode512(w) == QL_MODE_NIBBLE ? ql_make_layout(w, 32, 1) : ql_make_layout(w, 8, 0);
#endif
    (void)isa, (void)m, (void)a8;
    return ql_make_layout(w, 1, 0);
}

#define QL_ROW_TILE_BYTES (1 << 20) /* x rows per tile: about an L2 (a smaller tile costs more at 128 rows) */
#define QL_MIN_ROW_TILE 16            /* AVX-512 decodes odd widths once per tile: keep that amortized */

/* Chunks per thread of a product on m rows. Below QL_DECODE_ROWS rows a call is a pass over its
 * weights from memory: one contiguous run per thread, so each thread's stream (hardware and
 * software prefetch) never restarts mid-call: faster decode steps than 4 chunks a thread, for every
 * format (benchmarks/RESULTS.md). From QL_DECODE_ROWS rows on, the arithmetic dominates and ~4 a thread
 * balance the threads. */
static int ql_stream_chunks(int64_t m) { return m < QL_DECODE_ROWS ? 1 : 4; }

static int64_t ql_scratch_params(const ql_weight *w) { return ql_round_up(8 * w->groups, 16); }

/* Per-thread scratch: scale and zero of every group of 4 features, then one decoded group
 * (portable path), 4 decoded rows in the layout of x (AVX-512) or every row's zero-point terms
 * (int8 activations): `decoded_length` floats. */
static float *ql_scratch(const ql_weight *w, int64_t decoded_length) {
    int64_t floats = ql_scratch_params(w) + (decoded_length > w->group_codes ? decoded_length : w->group_codes);
    float *scratch = NULL;
    return posix_memalign((void **)&scratch, 64, (size_t)ql_round_up(floats, 16) * sizeof(float)) ? NULL : scratch;
}

typedef struct {
    const ql_weight *w;
    int isa;
    ql_layout layout;
    const float *xp;
    int64_t x_stride; /* row stride of xp: the prepared copy's row length, or the caller's x used as it is */
    int64_t m;
    float *out;
    int64_t out_stride;
    int64_t first;    /* dequantize: first feature */
    int64_t last;
    int64_t per_chunk;
    int a8;           /* int8 activations: the kernel (int8_activations.c), QL_A8_NONE for float x */
    const int8_t *xq; /* x quantized per block of 64 for it, else NULL */
    const float *xd;
    const int32_t *xs;
    int a8_rows;      /* the many-row int8-activation kernel, x in its natural order */
    _Atomic int failed;
} ql_job;

static void ql_gemm_chunk(void *arg, int64_t chunk) {
    ql_job *job = (ql_job *)arg;
    const ql_weight *w = job->w;
    int64_t n0 = chunk * job->per_chunk, n1 = n0 + job->per_chunk;
    if (n1 > w->n) n1 = w->n;
    int64_t row_length = w->groups * job->layout.padded_group;
    int64_t decoded_length = 0;
#ifdef QL_X86
    if (job->isa == QL_ISA_AVX512 && ql_mode512(w) == QL_MODE_BITS && job->m >= QL_DECODE_ROWS)
        decoded_length = 4 * row_length;
    if (job->isa == QL_ISA_AVX512 && job->m >= QL_AVX512_PANEL_ROWS) decoded_length = QL_AVX512_PANEL_FLOATS(row_length);
    if (ql_avx2_panels(job->isa, job->m, job->a8)) decoded_length = QL_DECODED_FEATURES * row_length;
    if (job->xq) decoded_length = job->m * w->groups; /* the int8-activation kernel's zero terms */
    if (job->a8_rows) {
        ql_a8_scratch rows;
        if (ql_a8_scratch_make(w, job->m, ql_a8_rows_panel(job->a8, job->m), &rows)) {
            atomic_store(&job->failed, 1);
            return;
        }
        ql_a8_rows_for(job->a8, job->m)(w, job->xq, job->xd, job->xs, job->m, n0, n1, job->out, job->out_stride, &rows);
        free(rows.xz);
        return;
    }
#endif
    float *scratch = ql_scratch(w, decoded_length);
    if (!scratch) {
        atomic_store(&job->failed, 1);
        return;
    }
#ifdef QL_X86
    if (job->a8 == QL_A8_VNNI || job->a8 == QL_A8_AVX2) {
        (job->a8 == QL_A8_VNNI ? ql_gemm512_a8 : ql_gemm256_a8)(w, job->xq, job->xd, job->xs, job->m, row_length, n0,
                                                                n1, job->out, job->out_stride, scratch,
                                                                scratch + ql_scratch_params(w));
        free(scratch);
        return;
    }
#endif
    /* Rows in tiles whose x stays in L2 while every block of 4 features of the chunk streams past
     * it; untiled, 512 rows of 2048 inputs (4 MiB) are read again from L3 for each block. Tiles are
     * whole blocks of 4 rows, so every output is computed exactly as without tiles. Faster on large
     * layers at many rows (every format); unchanged where x fits (benchmarks/RESULTS.md). */
    int64_t tile = QL_ROW_TILE_BYTES / (row_length * (int64_t)sizeof(float)) / 4 * 4;
    if (tile < QL_MIN_ROW_TILE) tile = QL_MIN_ROW_TILE;
    for (int64_t r0 = 0, rows; r0 < job->m; r0 += rows) {
        rows = job->m - r0 < tile + QL_MIN_ROW_TILE ? job->m - r0 : tile; /* no short last tile */
        const float *xp = job->xp + r0 * job->x_stride;
        float *out = job->out + r0 * job->out_stride;
#ifdef QL_X86
        if (job->isa == QL_ISA_AVX512)
            ql_gemm512(w, &job->layout, xp, rows, n0, n1, out, job->out_stride, scratch, scratch + ql_scratch_params(w));
        else if (job->isa == QL_ISA_AVX2)
            ql_gemm256(w, &job->layout, xp, job->x_stride, rows, n0, n1, out, job->out_stride, scratch,
                       decoded_length ? scratch + ql_scratch_params(w) : NULL);
        else
#endif
            ql_gemm_scalar(w, &job->layout, xp, rows, n0, n1, out, job->out_stride, scratch);
    }
    free(scratch);
}

static void ql_dequantize_chunk(void *arg, int64_t chunk) {
    ql_job *job = (ql_job *)arg;
    const ql_weight *w = job->w;
    int64_t n0 = job->first + chunk * job->per_chunk, n1 = n0 + job->per_chunk;
    if (n1 > job->last) n1 = job->last;
    float *out = job->out + (n0 - job->first) * job->out_stride;
    float *scratch = ql_scratch(w, 0);
    if (!scratch) {
        atomic_store(&job->failed, 1);
        return;
    }
#ifdef QL_X86
    if (job->isa == QL_ISA_AVX512)
        ql_dequantize512(w, n0, n1, out, job->out_stride, scratch);
    else if (job->isa == QL_ISA_AVX2)
        ql_dequantize256(w, n0, n1, out, job->out_stride, scratch);
    else
#endif
        ql_dequantize_scalar(w, n0, n1, out, job->out_stride, scratch);
    free(scratch);
}

/* Features a chunk of a product on m rows, `threads` threads sharing `features`: the many-row kernels
 * work in panels of 16 features (AVX2) or 32 (AVX-512), so their chunks are whole panels; AVX-512's ~4
 * a thread, as whole panels of 32 cut SmolLM2's 576 features into 6 even chunks where 8 a thread cut 9. */
static int64_t ql_chunk_for(int64_t features, int threads, int isa, int64_t m, int a8) {
    if (ql_a8_rows(a8, m)) return ql_round_up(ql_chunk_features(features, threads, 4), ql_a8_rows_panel(a8, m));
    if (ql_avx2_panels(isa, m, a8)) return ql_round_up(ql_chunk_features(features, threads, 8), 16);
    if (isa == QL_ISA_AVX512 && m >= QL_AVX512_PANEL_ROWS && a8 == QL_A8_NONE)
        return ql_round_up(ql_chunk_features(features, threads, 4), 32);
    return ql_chunk_features(features, threads, ql_stream_chunks(m));
}

/* The calling thread's buffer for x in the kernels' layout, kept between calls up to QL_REUSED_X_BYTES (a
 * fresh allocation of a many-row x faults its pages in on every call); NULL for a larger one. A product
 * runs to its end before its calling thread starts another, so one buffer a calling thread suffices. */
#define QL_REUSED_X_BYTES ((size_t)8 << 20)

static float *ql_reused_buffer(size_t bytes) {
    static _Thread_local float *buffer = NULL;
    static _Thread_local size_t capacity = 0;
    if (bytes > QL_REUSED_X_BYTES) return NULL;
    if (bytes > capacity) {
        free(buffer);
        capacity = 0;
        if (posix_memalign((void **)&buffer, 64, QL_REUSED_X_BYTES)) return buffer = NULL;
        capacity = QL_REUSED_X_BYTES;
    }
    return buffer;
}

/* Rows [chunk * per_chunk, ...) of x copied into the kernels' layout (ql_prepare_x). */
typedef struct {
    const ql_weight *w;
    const ql_layout *layout;
    const float *x;
    int64_t x_stride, m, per_chunk, row_length;
    float *copy;
} ql_prepare_job;

static void ql_prepare_chunk(void *arg, int64_t chunk) {
    const ql_prepare_job *job = (const ql_prepare_job *)arg;
    const int64_t first = chunk * job->per_chunk, last = first + job->per_chunk < job->m ? first + job->per_chunk : job->m;
    ql_prepare_x(job->w, job->layout, job->x + first * job->x_stride, last - first, job->x_stride,
                 job->copy + first * job->row_length);
}

/* x as the kernels read it, with its row stride in *stride: x itself where AVX2's many-row kernel (or a
 * many-row int8-activation kernel) reads the plain layout and that is x's (every group whole and a
 * multiple of 8 inputs: the usual layers in groups of 32-128), else a 64-byte aligned copy in the kernels'
 * layout (ql_prepare_x): the calling thread's reused buffer, or one returned in *copy for the caller to free.
 * NULL if out of memory. From
 * QL_DECODE_ROWS rows on the copy is shared among `threads` threads by rows: on one thread it was a
 * serial share of a many-row product that kept layers with few outputs (a few panels a thread) from
 * scaling to the second thread. */
static const float *ql_kernel_x(const ql_weight *w, const ql_layout *layout, int isa, int64_t m, int a8,
                                const float *x, int64_t x_stride, int64_t *stride, float **copy, int threads) {
    const int64_t row_length = w->groups * layout->padded_group;
    *copy = NULL;
    if ((ql_avx2_panels(isa, m, a8) || ql_a8_rows(a8, m)) && !layout->nibble && layout->padded_group == w->group_size &&
        row_length == w->k) {
        *stride = x_stride;
        return x;
    }
    const size_t bytes = (size_t)ql_round_up(m * row_length * (int64_t)sizeof(float) + 64, 64);
    float *buffer = ql_reused_buffer(bytes);
    if (!buffer) { /* larger than the reused buffer: one of its own, freed by the caller */
        if (posix_memalign((void **)copy, 64, bytes)) {
            *copy = NULL;
            return NULL;
        }
        buffer = *copy;
    }
    ql_prepare_job job = {.w = w, .layout = layout, .x = x, .x_stride = x_stride, .m = m, .row_length = row_length,
                          .copy = buffer};
    threads = m >= QL_DECODE_ROWS ? ql_threads(threads, m * row_length * (int64_t)sizeof(float)) : 1;
    job.per_chunk = (m + threads - 1) / threads;
    ql_run(ql_prepare_chunk, &job, (m + job.per_chunk - 1) / job.per_chunk, threads);
    *stride = row_length;
    return buffer;
}

/* y[m, n] (row stride y_stride) = x[m, k] (row stride x_stride) times the weight, transposed. */
QL_API int ql_gemm(const ql_weight *w, const float *x, int64_t m, int64_t x_stride, float *y, int64_t y_stride, int threads) {
    int status = ql_check(w);
    if (status != QL_OK) return status;
    ql_job job = {.w = w, .isa = ql_product_isa(w, m, w->n), .m = m, .out = y, .out_stride = y_stride};
    job.layout = ql_layout_for(w, job.isa, m, QL_A8_NONE);
    float *xp = NULL;
    threads = ql_threads(threads, w->n * w->groups * w->group_bytes * (m < 4 ? 1 : m / 4));
    job.xp = ql_kernel_x(w, &job.layout, job.isa, m, QL_A8_NONE, x, x_stride, &job.x_stride, &xp, threads);
    if (!job.xp) return QL_NO_MEMORY;
    job.per_chunk = threads > 1 ? ql_chunk_for(w->n, threads, job.isa, m, QL_A8_NONE) : w->n;
    int64_t chunks = (w->n + job.per_chunk - 1) / job.per_chunk;
    ql_run(ql_gemm_chunk, &job, chunks, threads);
    free(xp);
    return atomic_load(&job.failed) ? QL_NO_MEMORY : QL_OK;
}

/* Rows [chunk * per_chunk, ...) of x rounded to int8 blocks of 64 for the int8-activation kernels: x's
 * rows in their kernels' layout (x_stride apart), the int8 rows packed (row_length apart). */
typedef struct {
    int a8;
    const float *x;
    int64_t x_stride, row_length, m, per_chunk;
    int nibble;
    int8_t *xq;
    float *xd;
    int32_t *xs;
} ql_quantize_job;

#ifdef QL_X86
static void ql_quantize_chunk(void *arg, int64_t chunk) {
    const ql_quantize_job *job = (const ql_quantize_job *)arg;
    const int64_t blocks = job->row_length / 64, r1 = (chunk + 1) * job->per_chunk;
    for (int64_t r = chunk * job->per_chunk; r < job->m && r < r1; r++)
        (job->a8 == QL_A8_VNNI ? ql_quantize_x_a8 : ql_quantize_x_a8_256)(job->x + r * job->x_stride, 1, job->row_length,
                                                                          job->nibble, job->xq + r * job->row_length,
                                                                          job->xd + r * blocks, job->xs + r * blocks);
}
#endif

/* Several weights of one layout on the same x, as one call: chunk c belongs to the weight i with
 * first_chunk[i] <= c < first_chunk[i + 1], and is that weight's chunk c - first_chunk[i]. */
typedef struct {
    ql_job *jobs;
    int64_t *first_chunk;
} ql_group_job;

static void ql_gemm_group_chunk(void *arg, int64_t chunk) {
    ql_group_job *group = (ql_group_job *)arg;
    int64_t i = 0;
    while (chunk >= group->first_chunk[i + 1]) i++;
    ql_gemm_chunk(&group->jobs[i], chunk - group->first_chunk[i]);
}

int ql_same_layout(const ql_weight *a, const ql_weight *b) {
    return a->kind == b->kind && a->bits == b->bits && a->k == b->k && a->groups == b->groups &&
           a->group_size == b->group_size && a->group_codes == b->group_codes && a->group_bytes == b->group_bytes;
}

/* y[m, n_0 + ... + n_{count-1}] = x times each weight, transposed, side by side (weight i's outputs in
 * the columns after those of weights 0..i-1): q/k/v or gate/up projections of one input in one call.
 * x is prepared once and the features of all weights are cut into chunks of one size, which one
 * thread team takes in turn. Every chunk starts on a whole block of 4 features of its weight, as in
 * ql_gemm, so each output is computed by the same code as ql_gemm of its weight alone: bit for bit
 * the same values. The weights must share a layout (kind, bits, in_features, group shape).
 * activation_bits 8 (else 0) rounds x to int8 blocks of 64 for 4-bit affine and int8 weights in groups
 * of 64 or a multiple, on CPUs with AVX2 or AVX512-VNNI (int8_activations.c: faster, not bit-exact);
 * other formats and CPUs ignore it. */
QL_API int ql_gemm_group(const ql_weight *weights, int64_t count, const float *x, int64_t m, int64_t x_stride, float *y,
                         int64_t y_stride, int threads, int activation_bits) {
    if (count < 1 || (activation_bits != 0 && activation_bits != 8)) return QL_BAD_FORMAT;
    int64_t features = 0, work = 0, widest = 0;
    for (int64_t i = 0; i < count; i++) {
        const ql_weight *w = &weights[i];
        int status = ql_check(w);
        if (status != QL_OK) return status;
        if (!ql_same_layout(w, &weights[0])) return QL_BAD_FORMAT;
        features += w->n;
        work += w->n * w->groups * w->group_bytes;
        if (w->n > widest) widest = w->n;
    }
    if (features > y_stride) return QL_BAD_FORMAT;
    ql_job *jobs = calloc((size_t)count, sizeof(ql_job));
    int64_t *first_chunk = malloc((size_t)(count + 1) * sizeof(int64_t));
    /* int8 activations: the one-row kernels below QL_A8_ROWS rows, then the many-row ones */
    const int a8 = activation_bits == 8 && ql_a8_eligible(&weights[0]) ? ql_a8_kernel() : QL_A8_NONE;
    const int isa = a8 == QL_A8_NONE ? ql_product_isa(&weights[0], m, features) : ql_isa();
    /* the many-row kernels read x in its natural order, in whole blocks of 64 */
    ql_layout layout = ql_a8_rows(a8, m) ? ql_make_layout(&weights[0], 64, 0) : ql_layout_for(&weights[0], isa, m, a8);
    float *xp = NULL;
    int64_t x_stride_kernels = 0;
    const float *x_kernels =
        jobs && first_chunk ? ql_kernel_x(&weights[0], &layout, isa, m, a8, x, x_stride, &x_stride_kernels, &xp, threads)
                            : NULL;
    if (!x_kernels) {
        free(jobs);
        free(first_chunk);
        return QL_NO_MEMORY;
    }
    int8_t *xq = NULL; /* activation_bits 8: x as int8 blocks of 64, where the CPU and format allow */
    float *xd = NULL;
    int32_t *xs = NULL;
#ifdef QL_X86
    if (a8 != QL_A8_NONE) {
        int64_t blocks = m * weights[0].groups * layout.padded_group / 64;
        void *buffer = malloc((size_t)(blocks * (64 + sizeof(float) + sizeof(int32_t))));
        if (!buffer) {
            free(xp);
            free(jobs);
            free(first_chunk);
            return QL_NO_MEMORY;
        }
        xd = (float *)buffer;
        xs = (int32_t *)(xd + blocks);
        xq = (int8_t *)(xs + blocks);
    }
#endif
    threads = ql_threads(threads, work * (m < 4 ? 1 : m / 4));
#ifdef QL_X86
    if (a8 != QL_A8_NONE) {
        ql_quantize_job quantize = {.a8 = a8, .x = x_kernels, .x_stride = x_stride_kernels,
                                    .row_length = weights[0].groups * layout.padded_group, .m = m,
                                    .nibble = layout.nibble, .xq = xq, .xd = xd, .xs = xs};
        quantize.per_chunk = ql_a8_rows(a8, m) ? (m + threads - 1) / threads : m; /* a few rows: on this thread */
        ql_run(ql_quantize_chunk, &quantize, (m + quantize.per_chunk - 1) / quantize.per_chunk, threads);
    }
#endif
    int64_t per_chunk = threads > 1 ? ql_chunk_for(features, threads, isa, m, a8) : widest;
    first_chunk[0] = 0;
    for (int64_t i = 0, column = 0; i < count; column += weights[i].n, i++) {
        jobs[i] = (ql_job){.w = &weights[i], .isa = isa, .layout = layout, .xp = x_kernels, .x_stride = x_stride_kernels,
                           .m = m, .out = y + column,
                           .out_stride = y_stride, .per_chunk = per_chunk, .a8 = a8, .xq = xq, .xd = xd, .xs = xs,
                           .a8_rows = ql_a8_rows(a8, m)};
        first_chunk[i + 1] = first_chunk[i] + (weights[i].n + per_chunk - 1) / per_chunk;
    }
    ql_group_job group = {.jobs = jobs, .first_chunk = first_chunk};
    ql_run(ql_gemm_group_chunk, &group, first_chunk[count], threads);
    int failed = 0;
    for (int64_t i = 0; i < count; i++) failed |= atomic_load(&jobs[i].failed);
    free(xd); /* the start of the int8 buffer */
    free(xp);
    free(jobs);
    free(first_chunk);
    return failed ? QL_NO_MEMORY : QL_OK;
}

/* Rows [n0, n1) of the float weight into out (row stride out_stride). */
QL_API int ql_dequantize(const ql_weight *w, int64_t n0, int64_t n1, float *out, int64_t out_stride, int threads) {
    int status = ql_check(w);
    if (status != QL_OK) return status;
    if (n0 < 0 || n1 > w->n || n0 >= n1) return n0 == n1 ? QL_OK : QL_BAD_FORMAT;
    ql_job job = {.w = w, .isa = ql_isa(), .out = out, .out_stride = out_stride, .first = n0, .last = n1};
    threads = ql_threads(threads, (n1 - n0) * w->groups * w->group_bytes);
    job.per_chunk = threads > 1 ? ql_chunk_features(n1 - n0, threads, 4) : n1 - n0;
    ql_run(ql_dequantize_chunk, &job, (n1 - n0 + job.per_chunk - 1) / job.per_chunk, threads);
    return atomic_load(&job.failed) ? QL_NO_MEMORY : QL_OK;
}
