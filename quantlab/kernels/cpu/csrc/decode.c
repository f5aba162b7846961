/*
 * One decoding step of a Llama-family model as one call: every block's norms, projections,
 * rotary embedding, attention over the KV cache and MLP, for one token of one sequence.
 *
 * A compiled torch step runs the same work as hundreds of small kernels and operator calls
 * driven from Python; at one token each of those costs more than its arithmetic. Here the
 * quantized projections run on the same kernels (ql_gemm_group: q/k/v and gate/up as one call
 * each when they share a layout) and everything between them is a loop over a few hundred
 * floats. The caller (quantlab/generation/native.py) looks the token up, computes the rotary
 * cos/sin with the model's own rotary module (so every rope variant it implements works) and
 * applies the head when it is not in a native format.
 *
 * The block (LlamaDecoderLayer and its relatives):
 *   h += o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))  with n = rms_norm(h)
 *   h += down_proj(silu(gate_proj(n)) * up_proj(n))                     with n = rms_norm(h)
 * Keys and values of the token are written at `position` of the cache; attention reads
 * positions 0..position (one sequence, no padding: the caller falls back otherwise).
 */
#include "quantlab_cpu.h"

#include <math.h>

/* out = weight * x / sqrt(mean(x^2) + eps), as LlamaRMSNorm computes it in float32. */
static void ql_rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    double squares = 0.0;
    for (int64_t i = 0; i < n; i++) squares += (double)x[i] * x[i];
    float inverse = 1.0f / sqrtf((float)(squares / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inverse);
}

/* rotate_half rope on one head: x[j], x[j + d/2] turned by the angle whose cos/sin are at j. */
static void ql_rope(float *x, const float *cos, const float *sin, int64_t head_dim) {
    int64_t half = head_dim / 2;
    for (int64_t j = 0; j < half; j++) {
        float a = x[j], b = x[j + half];
        x[j] = a * cos[j] - b * sin[j];
        x[j + half] = b * cos[j + half] + a * sin[j + half];
    }
}

#ifdef QL_X86
QL_AVX512 static void ql_silu_times512(float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
        const __m512 e = ql_exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(gate + i, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, up + i)));
    }
}

QL_AVX2 static void ql_silu_times256(float *gate, const float *up, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = ql_exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}
#endif

/* x R in place, the online rotation of a layer quantized with its input rotated (quantlab/nn/rotation.py): on each
 * block of `r->block` values, the normalized Hadamard matrix H_core (x) H_p (p = block / core, a power of two),
 * value c p + j at row c, column j: Sylvester's transform along each row, then the +-1 matrix `r->core_signs`
 * (core x core, row-major, symmetric) down each column. Nothing when `r->block` is 0. */
static void ql_rotate(float *x, int64_t n, const ql_rotation *r) {
    if (r->block <= 0) return;
    const int64_t block = r->block, core = r->core, width = block / core;
    const float norm = 1.0f / sqrtf((float)block);
    float column[QL_MAX_HADAMARD_CORE];
    for (int64_t start = 0; start < n; start += block) {
        float *v = x + start;
        for (int64_t row = 0; row < core; row++) {
            float *w = v + row * width;
            for (int64_t half = 1; half < width; half <<= 1)
                for (int64_t i = 0; i < width; i += 2 * half)
                    for (int64_t j = i; j < i + half; j++) {
                        const float a = w[j], b = w[j + half];
                        w[j] = a + b;
                        w[j + half] = a - b;
                    }
        }
        for (int64_t j = 0; core > 1 && j < width; j++) {
            for (int64_t c = 0; c < core; c++) column[c] = v[c * width + j];
            for (int64_t row = 0; row < core; row++) {
                float sum = 0.0f;
                for (int64_t c = 0; c < core; c++) sum += r->core_signs[row * core + c] * column[c];
                v[row * width + j] = sum;
            }
        }
        for (int64_t i = 0; i < block; i++) v[i] *= norm;
    }
}

/* gate = silu(gate) * up = gate / (1 + exp(-gate)) * up, as LlamaMLP computes it. 16 at a time with AVX-512,
 * several times faster than the scalar loop in the decode step (benchmarks/RESULTS.md). */
static void ql_silu_times(int isa, float *gate, const float *up, int64_t n) {
#ifdef QL_X86
    if (isa == QL_ISA_AVX512) {
        ql_silu_times512(gate, up, n);
        return;
    }
    if (isa == QL_ISA_AVX2) {
        ql_silu_times256(gate, up, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void ql_add_bias(float *y, const float *bias, int64_t n) {
    if (bias)
        for (int64_t i = 0; i < n; i++) y[i] += bias[i];
}

/* ---- projections ------------------------------------------------------------------------------ */

/* y = x times each weight (outputs side by side), one grouped call when they share a layout. */
static int ql_project(const ql_weight *weights, const float *const *biases, int count, const float *x, float *y,
                      int threads, int activation_bits) {
    int same = 1;
    int64_t total = 0;
    for (int i = 0; i < count; i++) {
        total += weights[i].n;
        same &= ql_same_layout(&weights[i], &weights[0]);
    }
    if (same) {
        int status = ql_gemm_group(weights, count, x, 1, weights[0].k, y, total, threads, activation_bits);
        if (status != QL_OK) return status;
    } else {
        for (int i = 0, column = 0; i < count; column += (int)weights[i].n, i++) {
            int status = ql_gemm_group(&weights[i], 1, x, 1, weights[i].k, y + column, weights[i].n, threads,
                                       activation_bits);
            if (status != QL_OK) return status;
        }
    }
    for (int i = 0, column = 0; i < count; column += (int)weights[i].n, i++) ql_add_bias(y + column, biases[i], weights[i].n);
    return QL_OK;
}

/* ---- attention (attention.c) ------------------------------------------------------------------ */

typedef struct {
    const ql_decoder *decoder;
    const float *q;     /* [heads, head_dim], rope applied */
    const float *keys;  /* [kv_heads, max_len, head_dim] (a float cache) */
    const float *values;
    const ql_quantized_cache *quantized; /* else this cache, at layer `block` */
    int64_t block;
    int64_t length;     /* positions attended: 0..length-1 */
    int64_t max_len;    /* positions the cache holds */
    int isa;
    float *scores;      /* [heads, length] */
    float *out;         /* [heads, head_dim] */
} ql_step_attention;

/* Key/value head `kv` of a quantized cache's layer `b`, the step's token in the window included. */
static ql_kv_head ql_quantized_head(const ql_quantized_cache *c, int64_t b, int64_t kv, int64_t dim) {
    const int64_t chunks = c->capacity / c->residual, groups = dim / c->group;
    ql_kv_head head = {
        c->key_codes[b] + kv * c->capacity * dim,
        c->key_scales[b] + kv * chunks * dim,
        c->key_zeros[b] + kv * chunks * dim,
        c->value_codes[b] + kv * c->capacity * dim,
        c->value_scales[b] + kv * c->capacity * groups,
        c->value_zeros[b] + kv * c->capacity * groups,
        c->window_keys[b] + kv * c->residual * dim,
        c->window_values[b] + kv * c->residual * dim,
        c->stored,
        c->window + 1,
        c->residual,
        c->group,
    };
    return head;
}

static void ql_attention_head(void *arg, int64_t head) {
    const ql_step_attention *job = (const ql_step_attention *)arg;
    const ql_decoder *d = job->decoder;
    const int64_t dim = d->head_dim, kv = head / (d->heads / d->kv_heads);
    float *scores = job->scores + head * job->length, *out = job->out + head * dim;
    if (job->quantized) { /* its shapes were checked by ql_check_quantized_cache */
        const ql_kv_head kv_head = ql_quantized_head(job->quantized, job->block, kv, dim);
        ql_attend_quantized(job->isa, job->q + head * dim, &kv_head, dim, d->attention_scale, scores, out);
        return;
    }
    ql_attend(job->isa, job->q + head * dim, job->keys + kv * job->max_len * dim, job->values + kv * job->max_len * dim,
              NULL, job->length, dim, d->attention_scale, scores, out);
}

/* Writes the token's keys and values (k, v: [kv_heads, head_dim]) at `position` of a float cache's layer, or at
 * slot `window` of a quantized cache's window. */
static void ql_write_token(const ql_decoder *d, const ql_cache *cache, const ql_quantized_cache *quantized, int64_t b,
                           int64_t position, const float *k, const float *v) {
    const int64_t dim = d->head_dim;
    const size_t bytes = (size_t)dim * sizeof(float);
    for (int64_t h = 0; h < d->kv_heads; h++) {
        float *key, *value;
        if (quantized) {
            key = quantized->window_keys[b] + (h * quantized->residual + quantized->window) * dim;
            value = quantized->window_values[b] + (h * quantized->residual + quantized->window) * dim;
        } else {
            key = cache->keys[b] + (h * cache->max_len + position) * dim;
            value = cache->values[b] + (h * cache->max_len + position) * dim;
        }
        memcpy(key, k + h * dim, bytes);
        memcpy(value, v + h * dim, bytes);
    }
}
/* ---- the step --------------------------------------------------------------------------------- */

/* A rotation ql_rotate can apply to `n` values: none, or blocks dividing n whose core divides them, with its
 * matrix when the core is not 1 and the rest of the block a power of two. */
static int ql_rotation_fits(const ql_rotation *r, int64_t n) {
    if (r->block == 0) return 1;
    if (r->block < 0 || n % r->block || r->core < 1 || r->core > QL_MAX_HADAMARD_CORE || r->block % r->core) return 0;
    const int64_t width = r->block / r->core;
    return (width & (width - 1)) == 0 && (r->core == 1 || r->core_signs != NULL);
}

static int ql_check_decoder(const ql_decoder *d, int64_t position, int64_t max_len) {
    if (d->blocks < 1 || d->hidden < 1 || d->heads < 1 || d->kv_heads < 1 || d->heads % d->kv_heads ||
        d->head_dim < 2 || d->head_dim % 2 || d->intermediate < 1 || position < 0 || position >= max_len)
        return QL_BAD_FORMAT;
    for (int64_t b = 0; b < d->blocks; b++) {
        const ql_block *block = &d->block[b];
        if (block->q.k != d->hidden || block->q.n != d->heads * d->head_dim || block->k.n != d->kv_heads * d->head_dim ||
            block->v.n != d->kv_heads * d->head_dim || block->o.k != d->heads * d->head_dim || block->o.n != d->hidden ||
            block->gate.n != d->intermediate || block->up.n != d->intermediate || block->down.k != d->intermediate ||
            block->down.n != d->hidden || block->k.k != d->hidden || block->v.k != d->hidden ||
            block->gate.k != d->hidden || block->up.k != d->hidden ||
            !ql_rotation_fits(&block->qkv_rotation, d->hidden) || !ql_rotation_fits(&block->o_rotation, block->o.k) ||
            !ql_rotation_fits(&block->gate_up_rotation, d->hidden) ||
            !ql_rotation_fits(&block->down_rotation, d->intermediate))
            return QL_BAD_FORMAT;
    }
    if (d->head && (d->head->k != d->hidden)) return QL_BAD_FORMAT;
    return QL_OK;
}

/* A quantized cache the step can read: whole chunks stored, room in the window for the token, groups
 * dividing head_dim, the token at `position` = stored + window. */
static int ql_check_quantized_cache(const ql_decoder *d, const ql_quantized_cache *c, int64_t position) {
    if (c->residual < 1 || c->group < 1 || d->head_dim % c->group || d->head_dim > QL_MAX_HEAD_DIM || c->stored < 0 ||
        c->stored % c->residual || c->capacity % c->residual || c->stored > c->capacity || c->window < 0 ||
        c->window >= c->residual || position != c->stored + c->window)
        return QL_BAD_FORMAT;
    return QL_OK;
}

/* hidden: in, the token's embedding [hidden]; out, the final norm's output. cos/sin: [head_dim]
 * for the token's position. With a float cache (`quantized` NULL), the token's keys and values go to
 * `position` of every layer's cache (cache->keys[b]: [kv_heads, max_len, head_dim]) and cache->lengths[b]
 * (the cache's own count of positions written) grows by one. With a quantized cache (`cache` NULL) they go
 * to slot `window` of every layer's window and the caller counts them (and quantizes a full window).
 * logits [head->n] when the decoder has a head. */
typedef struct {
    const ql_decoder *d;
    const ql_cache *cache;
    const ql_quantized_cache *quantized;
    float *hidden;
    const float *cos, *sin;
    int64_t position;
    float *logits;
    int threads, activation_bits;
    int status;
} ql_step;

static void ql_step_body(void *arg);

QL_API int ql_decode_step(const ql_decoder *d, const ql_cache *cache, const ql_quantized_cache *quantized,
                          float *hidden, const float *cos, const float *sin, int64_t position, float *logits,
                          int threads, int activation_bits) {
    if (!cache == !quantized) return QL_BAD_FORMAT;
    int status = ql_check_decoder(d, position, quantized ? position + 1 : cache->max_len);
    if (status == QL_OK && quantized) status = ql_check_quantized_cache(d, quantized, position);
    if (status != QL_OK) return status;
    ql_step step = {d, cache, quantized, hidden, cos, sin, position, logits, threads, activation_bits, QL_OK};
    ql_run_team(ql_step_body, &step, threads); /* every product and attention of the step on one held team */
    return step.status;
}

/* The step itself, once its arguments were checked. */
static void ql_step_body(void *arg) {
    ql_step *step = (ql_step *)arg;
    const ql_decoder *d = step->d;
    const ql_cache *cache = step->cache;
    const ql_quantized_cache *quantized = step->quantized;
    float *hidden = step->hidden, *logits = step->logits;
    const float *cos = step->cos, *sin = step->sin;
    const int64_t position = step->position;
    const int threads = step->threads, activation_bits = step->activation_bits;
    int status = QL_OK;
    int64_t q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim, length = position + 1;
    int64_t widest = q_size + 2 * kv_size;
    if (2 * d->intermediate > widest) widest = 2 * d->intermediate;
    if (d->hidden > widest) widest = d->hidden;
    float *buffer = malloc((size_t)(widest + d->hidden + q_size + d->hidden + d->heads * length) * sizeof(float));
    if (!buffer) {
        step->status = QL_NO_MEMORY;
        return;
    }
    float *wide = buffer, *normed = wide + widest, *attended = normed + d->hidden, *delta = attended + q_size;
    float *scores = delta + d->hidden;
    int isa = ql_isa();
    for (int64_t b = 0; b < d->blocks && status == QL_OK; b++) {
        const ql_block *block = &d->block[b];
        ql_rms_norm(hidden, block->attention_norm, d->hidden, d->norm_eps, normed);
        ql_rotate(normed, d->hidden, &block->qkv_rotation);
        const ql_weight qkv[3] = {block->q, block->k, block->v};
        const float *qkv_bias[3] = {block->q_bias, block->k_bias, block->v_bias};
        status = ql_project(qkv, qkv_bias, 3, normed, wide, threads, activation_bits);
        if (status != QL_OK) break;
        float *q = wide, *k = wide + q_size, *v = k + kv_size;
        for (int64_t h = 0; h < d->heads; h++) ql_rope(q + h * d->head_dim, cos, sin, d->head_dim);
        for (int64_t h = 0; h < d->kv_heads; h++) ql_rope(k + h * d->head_dim, cos, sin, d->head_dim);
        ql_write_token(d, cache, quantized, b, position, k, v);
        ql_step_attention attention = {d, q, NULL, NULL, quantized, b, length, 0, isa, scores, attended};
        if (!quantized) {
            attention.keys = cache->keys[b];
            attention.values = cache->values[b];
            attention.max_len = cache->max_len;
        }
        const int64_t attention_work = length * d->heads * d->head_dim; /* on a held team, threads cost little */
        ql_run(ql_attention_head, &attention, d->heads, ql_in_team() || attention_work >= 32768 ? threads : 1);
        ql_rotate(attended, q_size, &block->o_rotation);
        const float *o_bias[1] = {block->o_bias};
        status = ql_project(&block->o, o_bias, 1, attended, delta, threads, activation_bits);
        if (status != QL_OK) break;
        for (int64_t i = 0; i < d->hidden; i++) hidden[i] += delta[i];

        ql_rms_norm(hidden, block->mlp_norm, d->hidden, d->norm_eps, normed);
        ql_rotate(normed, d->hidden, &block->gate_up_rotation);
        const ql_weight gate_up[2] = {block->gate, block->up};
        const float *gate_up_bias[2] = {block->gate_bias, block->up_bias};
        status = ql_project(gate_up, gate_up_bias, 2, normed, wide, threads, activation_bits);
        if (status != QL_OK) break;
        float *gate = wide, *up = wide + d->intermediate;
        ql_silu_times(isa, gate, up, d->intermediate);
        ql_rotate(gate, d->intermediate, &block->down_rotation);
        const float *down_bias[1] = {block->down_bias};
        status = ql_project(&block->down, down_bias, 1, gate, delta, threads, activation_bits);
        if (status != QL_OK) break;
        for (int64_t i = 0; i < d->hidden; i++) hidden[i] += delta[i];
    }
    if (status == QL_OK) {
        ql_rms_norm(hidden, d->final_norm, d->hidden, d->norm_eps, normed);
        memcpy(hidden, normed, (size_t)d->hidden * sizeof(float));
        if (!quantized)
            for (int64_t b = 0; b < d->blocks; b++) cache->lengths[b][0] += 1;
        if (d->head) {
            const float *no_bias[1] = {d->head_bias};
            status = ql_project(d->head, no_bias, 1, hidden, logits, threads, activation_bits);
        }
    }
    free(buffer);
    step->status = status;
}
