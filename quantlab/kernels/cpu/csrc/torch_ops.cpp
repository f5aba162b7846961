// quantlab's native CPU kernels as PyTorch operators: `quantlab::linear`, `quantlab::linear_group`,
// `quantlab::dequantize` and `quantlab::attention`.
//
// The operators describe a layer's stored tensors to the C kernels (ql_weight, quantlab_cpu.h) and
// call them; they are registered with the dispatcher, so a quantized layer is one operator call that
// torch.compile keeps in its graph, and an eager call costs the dispatcher's overhead, not a Python
// wrapper's. The kernels themselves stay in the C library loaded (and verified) by native.py: Python
// hands this extension the addresses of its entry points once (`quantlab_torch_ops_bind`), so both
// paths run the same code and share its thread pool. The gradient with respect to x (QLoRA trains
// adapters on frozen quantized layers) is `grad @ W`, decoding W again in the backward pass (a tile of
// output features at a time when W is large: see `grad_input`); it is registered here for the
// Autograd key, so an eager call never leaves C++. `linear_group` is several `linear`s of one layout on
// one x in one call, their outputs side by side (the compiled decode step's q/k/v and gate/up, fused by
// quantlab.generation.fusion after autograd): it has no autograd formula. Fake (meta) shapes are
// registered in Python (quantlab/kernels/cpu/ops.py).

extern "C" {
#include "quantlab_cpu.h"
}

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <array>
#include <charconv>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

using GemmFn = int (*)(const ql_weight *, const float *, int64_t, int64_t, float *, int64_t, int);
using DequantizeFn = int (*)(const ql_weight *, int64_t, int64_t, float *, int64_t, int);
using GemmGroupFn = int (*)(const ql_weight *, int64_t, const float *, int64_t, int64_t, float *, int64_t, int, int);
using ProductFn = int (*)(const ql_weight *, int64_t);
using AttentionFn = int (*)(const float *, const float *, const float *, const float *, const uint8_t *, int64_t,
                           int64_t, int64_t, int64_t, int64_t, float, float *, int);

GemmFn gemm_fn = nullptr;
GemmGroupFn gemm_group_fn = nullptr;
DequantizeFn dequantize_fn = nullptr;
ProductFn product_fn = nullptr;
AttentionFn attention_fn = nullptr;
float kind_levels[QL_KINDS][16]; // each fixed table kind's levels (QL_NF4, QL_IQ4_NL), zeros for the others
float absmax_map[256];

using Optional = const std::optional<at::Tensor> &;

// A weight's layout integers, given to the operators as one string (`StorageLayout.descriptor`, written by
// the layout's codec), e.g. "affine bits=4 in_features=576 group_size=64 zero=8": an eager call converts
// each Python number it is given on its own, and one string costs about what one number does. The codec
// names and kinds are those of the Python codec registry (tests/kernels/test_native_codecs.py checks them).
struct Layout {
    int64_t kind = -1, bits = 0, in_features = 0, group_size = 0, absmax_block = 0;
    double zero_const = 0.0;
};

Layout parse_layout(std::string_view text) {
    Layout layout;
    bool complete = true;
    size_t start = 0, seen = 0;
    while (start < text.size() && complete) {
        size_t end = text.find(' ', start);
        if (end == std::string_view::npos) end = text.size();
        std::string_view token = text.substr(start, end - start);
        start = end + 1;
        if (seen++ == 0) {
            layout.kind = token == "affine" ? QL_AFFINE : token == "int8" ? QL_INT8 : token == "nf4" ? QL_NF4 : token == "iq4_nl" ? QL_IQ4_NL : token == "lut" ? QL_LUT : -1;
            continue;
        }
        size_t equals = token.find('=');
        std::string_view key = token.substr(0, equals), value = token.substr(equals + 1);
        const char *first = value.data(), *last = value.data() + value.size();
        std::from_chars_result read{};
        if (equals == std::string_view::npos) read.ec = std::errc::invalid_argument;
        else if (key == "bits") read = std::from_chars(first, last, layout.bits);
        else if (key == "in_features") read = std::from_chars(first, last, layout.in_features);
        else if (key == "group_size") read = std::from_chars(first, last, layout.group_size);
        else if (key == "absmax_block") read = std::from_chars(first, last, layout.absmax_block);
        else if (key == "zero") read = std::from_chars(first, last, layout.zero_const);
        else read.ec = std::errc::invalid_argument;
        complete = read.ec == std::errc() && read.ptr == last;
    }
    TORCH_CHECK(complete && layout.kind >= 0 && layout.bits && layout.in_features > 0 && layout.group_size > 0,
                "quantlab: bad layout \"", std::string(text), "\" (expected e.g. \"affine bits=4 in_features=576 "
                "group_size=64 zero=8\", the descriptor of a quantlab.formats.layout.StorageLayout)");
    return layout;
}

int dtype_code(const at::Tensor &tensor) {
    switch (tensor.scalar_type()) {
    case at::kFloat: return QL_F32;
    case at::kHalf: return QL_F16;
    case at::kBFloat16: return QL_BF16;
    default: TORCH_CHECK(false, "quantlab: unsupported scale dtype ", tensor.scalar_type());
    }
}

// The tensor as the kernels read it: contiguous CPU memory, floats as float32/16/bf16.
at::Tensor readable(const at::Tensor &tensor) {
    TORCH_CHECK(tensor.device().is_cpu(), "quantlab: the CPU operators need CPU tensors");
    at::Tensor out = tensor;
    if (out.is_floating_point() && out.scalar_type() != at::kFloat && out.scalar_type() != at::kHalf &&
        out.scalar_type() != at::kBFloat16)
        out = out.to(at::kFloat);
    return out.contiguous();
}

// A weight described by its stored tensors; `keep` holds the (possibly converted) tensors alive.
struct Described {
    ql_weight weight;
    std::array<at::Tensor, 5> keep;
};

Described describe(const Layout &layout, const at::Tensor &codes, Optional scale, Optional zero,
                   Optional absmax_codes, Optional absmax_scale, Optional absmax_offset) {
    const int64_t kind = layout.kind, bits = layout.bits, in_features = layout.in_features;
    const int64_t group_size = layout.group_size, absmax_block = layout.absmax_block;
    const double zero_const = layout.zero_const;
    TORCH_CHECK(gemm_fn && dequantize_fn && gemm_group_fn && product_fn, "quantlab: the torch operators are not bound to the C kernels");
    TORCH_CHECK(codes.dim() == 3 && codes.element_size() == 1, "quantlab: codes must be [out, groups, bytes] of one-byte "
                "integers, got ", codes.sizes(), " ", codes.scalar_type());
    TORCH_CHECK(bits >= 2 && bits <= 8 && kind >= QL_AFFINE && kind < QL_KINDS, "quantlab: bad kind ", kind, " or bits ",
                bits);
    // The C kernels check the description's own consistency; the tensors must be as large as it says.
    const int64_t per_group = codes.size(0) * codes.size(1);
    auto check_grid = [&](Optional tensor, const char *name) {
        TORCH_CHECK(!tensor.has_value() || tensor->numel() == per_group, "quantlab: ", name, " must hold one value per "
                    "group (", per_group, "), got ", tensor->numel());
    };
    check_grid(scale, "scale");
    if (kind != QL_LUT) check_grid(zero, "zero"); // a lut layer passes its table there (checked below)
    check_grid(absmax_codes, "absmax_codes");
    if (absmax_codes.has_value()) {
        TORCH_CHECK(absmax_codes->element_size() == 1, "quantlab: absmax_codes must be one-byte integers");
        TORCH_CHECK(absmax_block >= 16 && absmax_scale.has_value() && absmax_offset.has_value() &&
                        absmax_scale->numel() * absmax_block >= per_group && absmax_offset->numel() == 1,
                    "quantlab: NF4 double quantization needs absmax_scale per block of ", absmax_block,
                    " groups and one absmax_offset");
    }
    Described d;
    std::memset(&d.weight, 0, sizeof d.weight);
    ql_weight &w = d.weight;
    at::Tensor c = readable(codes);
    d.keep[0] = c;
    w.codes = static_cast<const uint8_t *>(c.data_ptr());
    w.n = c.size(0);
    w.k = in_features;
    w.groups = c.size(1);
    w.group_bytes = c.size(2);
    w.group_size = group_size;
    w.group_codes = w.group_bytes * 8 / bits;
    w.bits = static_cast<int32_t>(bits);
    w.kind = static_cast<int32_t>(kind);
    w.zero_const = static_cast<float>(zero_const);
    if (scale.has_value()) {
        at::Tensor s = readable(*scale);
        d.keep[1] = s;
        w.scale = s.data_ptr();
        w.scale_dtype = dtype_code(s);
    }
    std::memcpy(w.levels, kind_levels[kind], sizeof w.levels);
    if (kind == QL_LUT) { // the layer's own table comes where other kinds take their zero points
        TORCH_CHECK(zero.has_value() && zero->numel() == (int64_t{1} << bits) && zero->numel() <= 16,
                    "quantlab: a lut layer needs its table of 2**bits levels");
        at::Tensor table = zero->to(at::kFloat).contiguous();
        std::memcpy(w.levels, table.data_ptr<float>(), sizeof(float) * table.numel());
    } else if (zero.has_value()) {
        at::Tensor z = readable(*zero);
        d.keep[2] = z;
        w.zero = z.data_ptr();
        w.zero_dtype = dtype_code(z);
    }
    if (kind == QL_NF4) {
        if (absmax_codes.has_value()) {
            TORCH_CHECK(absmax_scale.has_value() && absmax_offset.has_value(), "quantlab: incomplete double quant");
            at::Tensor ac = readable(*absmax_codes), as = readable(*absmax_scale).to(at::kFloat).contiguous();
            d.keep[3] = ac;
            d.keep[4] = as;
            w.absmax_codes = static_cast<const uint8_t *>(ac.data_ptr());
            w.absmax_scale = as.data_ptr<float>();
            w.absmax_offset = absmax_offset->to(at::kFloat).item<float>();
            w.absmax_block = absmax_block;
            std::memcpy(w.absmax_map, absmax_map, sizeof absmax_map);
        }
    }
    TORCH_CHECK(w.scale || w.absmax_codes, "quantlab: a scale (or NF4's double-quantized absmax) is required");
    return d;
}

// A weight up to this many float32 bytes is decoded whole (every layer of a small model), a larger one a
// tile of output features of about kDecodedTileBytes at a time, each tile multiplied as soon as it is
// decoded: the decoded copy stays in cache and the allocator reuses it, instead of a fresh weight-sized
// buffer per call (mostly page faults). Measured for the backward pass: the input gradient then costs
// about what fp32's `grad @ W` does, less than decoded whole (benchmarks/RESULTS.md).
constexpr int64_t kDecodedWholeBytes = 4 << 20;
constexpr int64_t kDecodedTileBytes = 2 << 20;

// Whether `rows` rows of x run as the weight decoded by the C library and multiplied by torch's GEMM rather than
// on the fused kernel: the product measured faster for this format, shape and row count on this machine
// (ql_product, set by quantlab.kernels.cpu.tune).
bool dequantize_first(const ql_weight &w, int64_t rows) { return product_fn(&w, rows) == QL_PRODUCT_DECODED; }

// A buffer a weight (or a tile of it) is decoded into (float32) or rounded into (bfloat16), kept between calls by
// each calling thread: a fresh buffer per call costs its page faults, more than the decoding itself on small layers.
at::Tensor decode_buffer(int64_t rows, int64_t columns, at::ScalarType dtype) {
    thread_local at::Tensor buffers[2];  // float32, bfloat16
    at::Tensor &buffer = buffers[dtype == at::kBFloat16 ? 1 : 0];
    const int64_t size = rows * columns;
    if (!buffer.defined() || buffer.numel() < size) buffer = at::empty({size}, at::TensorOptions().dtype(dtype));
    return buffer.narrow(0, 0, size).view({rows, columns});
}

// out[rows, n] (rows of stride out.stride(0)) = flat @ W.T, W decoded whole or a tile of output features
// at a time (kDecodedWholeBytes): each decoded value is the reference's, the sums torch's GEMM's. A bfloat16
// `flat` (bf16_product) meets each tile rounded to bfloat16, in torch's bf16 GEMM.
void dequantized_matmul(const ql_weight &w, const at::Tensor &flat, const at::Tensor &out) {
    const int64_t n = w.n, k = flat.size(1);
    const int64_t tile = n * k * 4 <= kDecodedWholeBytes ? n : std::max<int64_t>(4, kDecodedTileBytes / (4 * k));
    const bool bf16 = flat.scalar_type() == at::kBFloat16;
    at::Tensor buffer = decode_buffer(std::min(tile, n), k, at::kFloat);
    at::Tensor rounded = bf16 ? decode_buffer(std::min(tile, n), k, at::kBFloat16) : at::Tensor();
    for (int64_t first = 0; first < n; first += tile) {
        const int64_t count = std::min(tile, n - first);
        at::Tensor part = buffer.narrow(0, 0, count);
        int status = dequantize_fn(&w, first, first + count, part.data_ptr<float>(), k, at::get_num_threads());
        TORCH_CHECK(status == 0, "quantlab native dequantize failed with status ", status);
        if (bf16) part = rounded.narrow(0, 0, count).copy_(part);
        at::Tensor columns = out.narrow(1, first, count);
        at::mm_out(columns, flat, part.t());
    }
}

// bfloat16 activations at kBf16Rows rows and more, on a CPU with AVX512-BF16 (on Intel CPUs with AMX, oneDNN runs
// torch's bf16 GEMM on the tiles): the weight decoded, rounded to bfloat16 and multiplied by torch's bf16 GEMM,
// the compute dtype a bf16 model asks for (not the float32 sums of the other paths); about twice the speed of
// the float32 products on Zen 4, which the measured crossover with the fused kernel (32-128 rows) puts at 128
// rows (benchmarks/RESULTS.md). Below, or without those instructions, x goes to float32 as before.
constexpr int64_t kBf16Rows = 128;

bool cpu_has_bf16_gemm() {
#if defined(__x86_64__) || defined(__i386__)
    static const bool has = [] {
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));  // AVX512_BF16
    }();
    return has;
#else
    return false;
#endif
}

bool bf16_product(const at::Tensor &x, int64_t rows) {
    return x.scalar_type() == at::kBFloat16 && rows >= kBf16Rows && cpu_has_bf16_gemm();
}

at::Tensor linear(const at::Tensor &x, Optional bias, c10::string_view layout_text, const at::Tensor &codes,
                  Optional scale, Optional zero, Optional absmax_codes, Optional absmax_scale, Optional absmax_offset) {
    const Layout layout = parse_layout(layout_text);
    const int64_t in_features = layout.in_features;
    TORCH_CHECK(x.device().is_cpu() && x.is_floating_point(), "quantlab::linear: x must be a floating CPU tensor");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features, "quantlab::linear: x has ", x.size(-1),
                " features, the weight ", in_features);
    Described d = describe(layout, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset);
    // x as float32 rows with unit stride: as given when it is (a decoding step's [1, k] or [b, 1, k]),
    // so a one-row call allocates its output and nothing else (each tensor op costs time there).
    at::Tensor flat = x.dim() == 2 ? x : x.reshape({-1, in_features});
    const bool bf16 = bf16_product(flat, flat.size(0));  // many bf16 rows stay bf16, on torch's bf16 GEMM
    if (bf16)
        flat = flat.contiguous();
    else if (flat.scalar_type() != at::kFloat || flat.stride(1) != 1)
        flat = flat.to(at::kFloat).contiguous();
    const int64_t rows = flat.size(0), n = d.weight.n;
    c10::SmallVector<int64_t, 4> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n;
    at::Tensor out = at::empty(shape, flat.options());
    if (bf16 || dequantize_first(d.weight, rows)) {
        dequantized_matmul(d.weight, flat, out.view({rows, n}));
    } else if (rows) {
        int status = gemm_fn(&d.weight, flat.data_ptr<float>(), rows, flat.stride(0), out.data_ptr<float>(), n,
                             at::get_num_threads());
        TORCH_CHECK(status == 0, "quantlab native matmul failed with status ", status);
    }
    if (x.scalar_type() != out.scalar_type()) out = out.to(x.scalar_type());
    if (bias.has_value()) out.add_(bias->to(out.scalar_type()));  // as the reference: the output's dtype, then add
    return out;
}

using OptionalList = const c10::List<std::optional<at::Tensor>> &;

// x @ W_i.T + bias_i for every weight i, side by side in one [..., sum of out_i] tensor; each value as
// `linear` computes it for that weight alone.
at::Tensor linear_group(const at::Tensor &x, OptionalList bias, c10::string_view layout_text, at::TensorList codes,
                        OptionalList scale, OptionalList zero, OptionalList absmax_codes, OptionalList absmax_scale,
                        OptionalList absmax_offset, int64_t activation_bits) {
    const Layout layout = parse_layout(layout_text);
    const int64_t in_features = layout.in_features;
    TORCH_CHECK(x.device().is_cpu() && x.is_floating_point(), "quantlab::linear_group: x must be a floating CPU tensor");
    TORCH_CHECK(activation_bits == 0 || activation_bits == 8, "quantlab::linear_group: activation_bits is 0 (float) "
                "or 8, got ", activation_bits);
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features, "quantlab::linear_group: x has ", x.size(-1),
                " features, the weights ", in_features);
    const size_t count = codes.size();
    TORCH_CHECK(count >= 1, "quantlab::linear_group: no weights");
    for (const auto *list : {&bias, &scale, &zero, &absmax_codes, &absmax_scale, &absmax_offset})
        TORCH_CHECK(list->size() == count, "quantlab::linear_group: every argument list needs ", count, " entries");
    std::vector<Described> described;
    std::vector<ql_weight> weights;
    described.reserve(count);
    weights.reserve(count);
    int64_t features = 0;
    for (size_t i = 0; i < count; i++) {
        described.push_back(describe(layout, codes[i], scale[i], zero[i], absmax_codes[i], absmax_scale[i],
                                     absmax_offset[i]));
        weights.push_back(described.back().weight);
        features += weights.back().n;
    }
    at::Tensor flat = x.reshape({-1, in_features});
    const bool bf16 = activation_bits == 0 && bf16_product(flat, flat.size(0));
    if (bf16)
        flat = flat.contiguous();
    else if (flat.scalar_type() != at::kFloat || flat.stride(1) != 1)
        flat = flat.to(at::kFloat).contiguous();
    const int64_t rows = flat.size(0);
    at::Tensor out = at::empty({rows, features}, flat.options());
    ql_weight group_shape = weights[0];  // the product is chosen for the group's whole width
    group_shape.n = features;
    if (bf16 || (activation_bits == 0 && dequantize_first(group_shape, rows))) {
        for (int64_t i = 0, column = 0; i < static_cast<int64_t>(count); column += weights[i].n, i++)
            dequantized_matmul(weights[i], flat, out.narrow(1, column, weights[i].n));
    } else if (rows) {
        int status = gemm_group_fn(weights.data(), static_cast<int64_t>(count), flat.data_ptr<float>(), rows,
                                   flat.stride(0), out.data_ptr<float>(), features, at::get_num_threads(),
                                   static_cast<int>(activation_bits));
        TORCH_CHECK(status == 0, "quantlab native grouped matmul failed with status ", status);
    }
    if (x.scalar_type() != out.scalar_type()) out = out.to(x.scalar_type());
    for (int64_t i = 0, column = 0; i < static_cast<int64_t>(count); column += weights[i].n, i++) {
        std::optional<at::Tensor> b = bias[i];
        if (b.has_value()) out.narrow(1, column, weights[i].n).add_(b->to(out.scalar_type()));  // as `linear` does
    }
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = features;
    return out.view(shape);
}

// One-token queries of the compiled decode step (quantlab.generation.attention), in C (attention.c):
// query [batch, kv_heads, groups, dim] (the query heads of key/value head h are its `groups` rows), key
// and value [batch, kv_heads, length, dim] (a static cache, read in place), mask None or [batch or 1, 1,
// 1, length]: bool (true attends) or float (added to the scores). Returns [batch, kv_heads, groups, dim].
at::Tensor attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, Optional mask,
                     double scale) {
    for (const at::Tensor *t : {&query, &key, &value})
        TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4,
                    "quantlab::attention: query, key and value must be 4-d float32 CPU tensors");
    const int64_t batch = query.size(0), kv_heads = query.size(1), groups = query.size(2), dim = query.size(3);
    const int64_t length = key.size(2);
    TORCH_CHECK(key.size(0) == batch && key.size(1) == kv_heads && key.size(3) == dim && value.sizes() == key.sizes(),
                "quantlab::attention: key and value must be [batch, kv_heads, length, dim] of the query's "
                "[batch, kv_heads, groups, dim], got ", key.sizes(), " and ", value.sizes(), " for ", query.sizes());
    const at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
    at::Tensor rows;  // the mask, one contiguous row per sequence: bool as it is (C reads its bytes), else float
    if (mask.has_value()) {
        TORCH_CHECK(mask->dim() == 4 && (mask->size(0) == batch || mask->size(0) == 1) && mask->size(1) == 1 &&
                        mask->size(2) == 1 && mask->size(3) == length,
                    "quantlab::attention: the mask must be [batch or 1, 1, 1, length], got ", mask->sizes());
        rows = mask->expand({batch, 1, 1, length}).reshape({batch, length});
        rows = rows.scalar_type() == at::kBool ? rows.contiguous() : rows.to(at::kFloat).contiguous();
    }
    const bool allowed = rows.defined() && rows.scalar_type() == at::kBool;
    at::Tensor out = at::empty_like(q);
    const int status = attention_fn(
        q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
        rows.defined() && !allowed ? rows.data_ptr<float>() : nullptr,
        allowed ? reinterpret_cast<const uint8_t *>(rows.data_ptr<bool>()) : nullptr, batch, kv_heads, groups, length,
        dim, static_cast<float>(scale), out.data_ptr<float>(), at::get_num_threads());
    TORCH_CHECK(status == 0, "quantlab native attention failed with status ", status);
    return out;
}

at::Tensor dequantize(c10::string_view layout_text, const at::Tensor &codes, Optional scale, Optional zero,
                      Optional absmax_codes, Optional absmax_scale, Optional absmax_offset) {
    const Layout layout = parse_layout(layout_text);
    const int64_t in_features = layout.in_features;
    Described d = describe(layout, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset);
    at::Tensor out = at::empty({d.weight.n, in_features}, codes.options().dtype(at::kFloat));
    int status = dequantize_fn(&d.weight, 0, d.weight.n, out.data_ptr<float>(), in_features, at::get_num_threads());
    TORCH_CHECK(status == 0, "quantlab native dequantize failed with status ", status);
    return out;
}

at::Tensor linear_below_autograd(const at::Tensor &x, Optional bias, c10::string_view layout_text,
                                 const at::Tensor &codes, Optional scale, Optional zero, Optional absmax_codes,
                                 Optional absmax_scale, Optional absmax_offset) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("quantlab::linear", "").typed<decltype(linear)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, bias, layout_text, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset);
}

at::Tensor dequantize_op(c10::string_view layout_text, const at::Tensor &codes, Optional scale, Optional zero,
                         Optional absmax_codes, Optional absmax_scale, Optional absmax_offset) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("quantlab::dequantize", "").typed<decltype(dequantize)>();
    return op.call(layout_text, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset);
}

at::Tensor optional_or_undefined(Optional tensor) { return tensor.has_value() ? *tensor : at::Tensor(); }

std::optional<at::Tensor> defined_or_none(const at::Tensor &tensor) {
    return tensor.defined() ? std::optional<at::Tensor>(tensor) : std::nullopt;
}

// The features [first, first + count) of a weight's per-group tensor ([out, groups] or flat).
std::optional<at::Tensor> feature_rows(Optional tensor, int64_t groups, int64_t first, int64_t count) {
    if (!tensor.has_value()) return std::nullopt;
    return tensor->reshape({-1}).narrow(0, first * groups, count * groups);
}

// grad @ W for the gradient with respect to x: [rows, out] -> [rows, in], float32.
at::Tensor grad_input(const at::Tensor &grad, const std::vector<at::Tensor> &saved, const std::string &layout_text) {
    const Layout layout = parse_layout(layout_text);
    auto weight = [&](const at::Tensor &codes, Optional scale, Optional zero, Optional absmax_codes,
                      Optional absmax_scale) {
        return dequantize_op(layout_text, codes, scale, zero, absmax_codes, absmax_scale, defined_or_none(saved[5]));
    };
    const at::Tensor &codes = saved[0];
    const int64_t out = codes.size(0), in = layout.in_features, groups = codes.size(1);
    at::Tensor flat = grad.to(at::kFloat).reshape({-1, out});
    if (out * in * 4 <= kDecodedWholeBytes)  // one GEMM: the reference's exact sums
        return at::mm(flat, weight(codes, defined_or_none(saved[1]), defined_or_none(saved[2]),
                                   defined_or_none(saved[3]), defined_or_none(saved[4])));
    // Whole blocks of NF4's double-quantized absmax: a tile of `align` features starts on a block.
    const int64_t block = layout.absmax_block, align = block > 0 ? block : 4;
    int64_t tile = kDecodedTileBytes / (4 * in) / align * align;
    if (tile < align) tile = align;
    at::Tensor result;
    for (int64_t first = 0; first < out; first += tile) {
        const int64_t count = std::min(tile, out - first);
        std::optional<at::Tensor> absmax_scale;
        if (saved[4].defined())
            absmax_scale = saved[4].reshape({-1}).narrow(0, first * groups / block, (count * groups + block - 1) / block);
        at::Tensor part = weight(codes.narrow(0, first, count), feature_rows(defined_or_none(saved[1]), groups, first, count),
                                 layout.kind == QL_LUT ? defined_or_none(saved[2])  // a lut layer's table: whole
                                                       : feature_rows(defined_or_none(saved[2]), groups, first, count),
                                 feature_rows(defined_or_none(saved[3]), groups, first, count), absmax_scale);
        at::Tensor slice = flat.narrow(1, first, count);
        if (result.defined())
            result.addmm_(slice, part);
        else
            result = at::mm(slice, part);
    }
    return result;
}

// x @ W.T + bias, with the gradients grad @ W for x and grad summed over rows for the bias; the
// stored tensors (buffers) get none.
struct LinearFunction : public torch::autograd::Function<LinearFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x, Optional bias,
                              c10::string_view layout_text, const at::Tensor &codes, Optional scale, Optional zero,
                              Optional absmax_codes, Optional absmax_scale, Optional absmax_offset) {
        ctx->save_for_backward({codes, optional_or_undefined(scale), optional_or_undefined(zero),
                                optional_or_undefined(absmax_codes), optional_or_undefined(absmax_scale),
                                optional_or_undefined(absmax_offset)});
        ctx->saved_data["layout"] = std::string(layout_text);
        ctx->saved_data["bias_dtype"] = bias.has_value() ? bias->scalar_type() : at::kFloat;
        return linear_below_autograd(x, bias, layout_text, codes, scale, zero, absmax_codes, absmax_scale,
                                     absmax_offset);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        torch::autograd::variable_list result(9);
        const at::Tensor &grad = grads[0];
        if (ctx->needs_input_grad(0)) {
            auto saved = ctx->get_saved_variables();
            const std::string layout_text = ctx->saved_data["layout"].toStringRef();
            at::Tensor input = grad_input(grad, saved, layout_text);
            std::vector<int64_t> shape(grad.sizes().begin(), grad.sizes().end());
            shape.back() = parse_layout(layout_text).in_features;
            result[0] = input.view(shape).to(grad.scalar_type());
        }
        if (ctx->needs_input_grad(1)) {
            at::Tensor rows = grad.reshape({-1, grad.size(-1)});
            result[1] = rows.sum(0).to(ctx->saved_data["bias_dtype"].toScalarType());
        }
        return result;
    }
};

at::Tensor linear_autograd(const at::Tensor &x, Optional bias, c10::string_view layout_text, const at::Tensor &codes,
                           Optional scale, Optional zero, Optional absmax_codes, Optional absmax_scale,
                           Optional absmax_offset) {
    // Without gradients (inference, decoding) skip building an autograd node: about a microsecond a call.
    if (!at::GradMode::is_enabled() || !(x.requires_grad() || (bias.has_value() && bias->requires_grad())))
        return linear_below_autograd(x, bias, layout_text, codes, scale, zero, absmax_codes, absmax_scale,
                                     absmax_offset);
    return LinearFunction::apply(x, bias, layout_text, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset);
}

// linear_group runs after autograd (in compiled inference graphs): with gradients asked for it refuses
// instead of silently giving none.
at::Tensor linear_group_autograd(const at::Tensor &x, OptionalList bias, c10::string_view layout_text,
                                 at::TensorList codes, OptionalList scale, OptionalList zero, OptionalList absmax_codes,
                                 OptionalList absmax_scale, OptionalList absmax_offset, int64_t activation_bits) {
    bool needs_grad = x.requires_grad();
    for (const std::optional<at::Tensor> &b : bias) needs_grad |= b.has_value() && b->requires_grad();
    TORCH_CHECK(!at::GradMode::is_enabled() || !needs_grad, "quantlab::linear_group has no gradient: call "
                "quantlab::linear per layer when training");
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("quantlab::linear_group", "")
                         .typed<decltype(linear_group)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, bias, layout_text, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset,
                   activation_bits);
}

}  // namespace

// Called once from Python with the C library's entry points, the levels of every kind (QL_KINDS x 16) and NF4's
// absmax map.
extern "C" __attribute__((visibility("default"))) int quantlab_torch_ops_bind(void *gemm, void *gemm_group,
                                                                             void *dequantize_entry,
                                                                             void *product,
                                                                             void *attention_entry,
                                                                             const float *levels, const float *map) {
    gemm_fn = reinterpret_cast<GemmFn>(gemm);
    gemm_group_fn = reinterpret_cast<GemmGroupFn>(gemm_group);
    dequantize_fn = reinterpret_cast<DequantizeFn>(dequantize_entry);
    product_fn = reinterpret_cast<ProductFn>(product);
    attention_fn = reinterpret_cast<AttentionFn>(attention_entry);
    std::memcpy(kind_levels, levels, sizeof kind_levels);
    std::memcpy(absmax_map, map, sizeof absmax_map);
    return QL_ABI_VERSION;
}

// The weight: its layout string (parse_layout), its codes, then its other stored tensors; a layout that
// stores fewer leaves the rest out (an eager call converts each argument it is given, None included).
#define WEIGHT_ARGS                                                                                                \
    "str layout, Tensor codes, Tensor? scale=None, Tensor? zero=None, Tensor? absmax_codes=None, "                \
    "Tensor? absmax_scale=None, Tensor? absmax_offset=None"

TORCH_LIBRARY(quantlab, m) {
    m.def("linear(Tensor x, Tensor? bias, " WEIGHT_ARGS ") -> Tensor");
    m.def("linear_group(Tensor x, Tensor?[] bias, str layout, Tensor[] codes, Tensor?[] scale, Tensor?[] zero, "
          "Tensor?[] absmax_codes, Tensor?[] absmax_scale, Tensor?[] absmax_offset, int activation_bits=0) -> Tensor");
    m.def("dequantize(" WEIGHT_ARGS ") -> Tensor");
    m.def("attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantlab, CPU, m) {
    m.impl("linear", &linear);
    m.impl("linear_group", &linear_group);
    m.impl("dequantize", &dequantize);
    m.impl("attention", &attention);
}

TORCH_LIBRARY_IMPL(quantlab, Autograd, m) {
    m.impl("linear", &linear_autograd);
    m.impl("linear_group", &linear_group_autograd);
}
