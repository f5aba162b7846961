// quantlab's native CPU kernels as PyTorch operators: `quantlab::linear`, `quantlab::linear_group` and
// `quantlab::dequantize`.
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

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using GemmFn = int (*)(const ql_weight *, const float *, int64_t, int64_t, float *, int64_t, int);
using DequantizeFn = int (*)(const ql_weight *, int64_t, int64_t, float *, int64_t, int);
using GemmGroupFn = int (*)(const ql_weight *, int64_t, const float *, int64_t, int64_t, float *, int64_t, int, int);

GemmFn gemm_fn = nullptr;
GemmGroupFn gemm_group_fn = nullptr;
DequantizeFn dequantize_fn = nullptr;
float nf4_levels[16];
float absmax_map[256];

using Optional = const std::optional<at::Tensor> &;

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
    std::vector<at::Tensor> keep;
};

Described describe(const at::Tensor &codes, Optional scale, Optional zero, Optional absmax_codes,
                   Optional absmax_scale, Optional absmax_offset, int64_t kind, int64_t bits, int64_t in_features,
                   int64_t group_size, int64_t absmax_block, double zero_const) {
    TORCH_CHECK(gemm_fn && dequantize_fn && gemm_group_fn, "quantlab: the torch operators are not bound to the C kernels");
    TORCH_CHECK(codes.dim() == 3 && codes.element_size() == 1, "quantlab: codes must be [out, groups, bytes] of one-byte "
                "integers, got ", codes.sizes(), " ", codes.scalar_type());
    TORCH_CHECK(bits >= 2 && bits <= 8 && kind >= QL_AFFINE && kind <= QL_NF4, "quantlab: bad kind ", kind, " or bits ",
                bits);
    // The C kernels check the description's own consistency; the tensors must be as large as it says.
    const int64_t per_group = codes.size(0) * codes.size(1);
    auto check_grid = [&](Optional tensor, const char *name) {
        TORCH_CHECK(!tensor.has_value() || tensor->numel() == per_group, "quantlab: ", name, " must hold one value per "
                    "group (", per_group, "), got ", tensor->numel());
    };
    check_grid(scale, "scale");
    check_grid(zero, "zero");
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
    d.keep.push_back(c);
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
        d.keep.push_back(s);
        w.scale = s.data_ptr();
        w.scale_dtype = dtype_code(s);
    }
    if (zero.has_value()) {
        at::Tensor z = readable(*zero);
        d.keep.push_back(z);
        w.zero = z.data_ptr();
        w.zero_dtype = dtype_code(z);
    }
    if (kind == QL_NF4) {
        std::memcpy(w.levels, nf4_levels, sizeof nf4_levels);
        if (absmax_codes.has_value()) {
            TORCH_CHECK(absmax_scale.has_value() && absmax_offset.has_value(), "quantlab: incomplete double quant");
            at::Tensor ac = readable(*absmax_codes), as = readable(*absmax_scale).to(at::kFloat).contiguous();
            d.keep.push_back(ac);
            d.keep.push_back(as);
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

at::Tensor linear(const at::Tensor &x, Optional bias, const at::Tensor &codes, Optional scale, Optional zero,
                  Optional absmax_codes, Optional absmax_scale, Optional absmax_offset, int64_t kind, int64_t bits,
                  int64_t in_features, int64_t group_size, int64_t absmax_block, double zero_const) {
    TORCH_CHECK(x.device().is_cpu() && x.is_floating_point(), "quantlab::linear: x must be a floating CPU tensor");
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_features, "quantlab::linear: x has ", x.size(-1),
                " features, the weight ", in_features);
    Described d = describe(codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind, bits, in_features,
                           group_size, absmax_block, zero_const);
    at::Tensor flat = x.reshape({-1, in_features});
    if (flat.scalar_type() != at::kFloat || flat.stride(1) != 1) flat = flat.to(at::kFloat).contiguous();
    const int64_t rows = flat.size(0), n = d.weight.n;
    at::Tensor out = at::empty({rows, n}, flat.options());
    if (rows) {
        int status = gemm_fn(&d.weight, flat.data_ptr<float>(), rows, flat.stride(0), out.data_ptr<float>(), n,
                             at::get_num_threads());
        TORCH_CHECK(status == 0, "quantlab native matmul failed with status ", status);
    }
    if (x.scalar_type() != at::kFloat) out = out.to(x.scalar_type());
    if (bias.has_value()) out.add_(bias->to(out.scalar_type()));  // as the reference: the output's dtype, then add
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n;
    return out.view(shape);
}

using OptionalList = const c10::List<std::optional<at::Tensor>> &;

// x @ W_i.T + bias_i for every weight i, side by side in one [..., sum of out_i] tensor; each value as
// `linear` computes it for that weight alone.
at::Tensor linear_group(const at::Tensor &x, OptionalList bias, at::TensorList codes, OptionalList scale,
                        OptionalList zero, OptionalList absmax_codes, OptionalList absmax_scale,
                        OptionalList absmax_offset, int64_t kind, int64_t bits, int64_t in_features,
                        int64_t group_size, int64_t absmax_block, double zero_const, int64_t activation_bits) {
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
        described.push_back(describe(codes[i], scale[i], zero[i], absmax_codes[i], absmax_scale[i], absmax_offset[i],
                                     kind, bits, in_features, group_size, absmax_block, zero_const));
        weights.push_back(described.back().weight);
        features += weights.back().n;
    }
    at::Tensor flat = x.reshape({-1, in_features});
    if (flat.scalar_type() != at::kFloat || flat.stride(1) != 1) flat = flat.to(at::kFloat).contiguous();
    const int64_t rows = flat.size(0);
    at::Tensor out = at::empty({rows, features}, flat.options());
    if (rows) {
        int status = gemm_group_fn(weights.data(), static_cast<int64_t>(count), flat.data_ptr<float>(), rows,
                                   flat.stride(0), out.data_ptr<float>(), features, at::get_num_threads(),
                                   static_cast<int>(activation_bits));
        TORCH_CHECK(status == 0, "quantlab native grouped matmul failed with status ", status);
    }
    if (x.scalar_type() != at::kFloat) out = out.to(x.scalar_type());
    for (int64_t i = 0, column = 0; i < static_cast<int64_t>(count); column += weights[i].n, i++) {
        std::optional<at::Tensor> b = bias[i];
        if (b.has_value()) out.narrow(1, column, weights[i].n).add_(b->to(out.scalar_type()));  // as `linear` does
    }
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = features;
    return out.view(shape);
}

at::Tensor dequantize(const at::Tensor &codes, Optional scale, Optional zero, Optional absmax_codes,
                      Optional absmax_scale, Optional absmax_offset, int64_t kind, int64_t bits, int64_t in_features,
                      int64_t group_size, int64_t absmax_block, double zero_const) {
    Described d = describe(codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind, bits, in_features,
                           group_size, absmax_block, zero_const);
    at::Tensor out = at::empty({d.weight.n, in_features}, codes.options().dtype(at::kFloat));
    int status = dequantize_fn(&d.weight, 0, d.weight.n, out.data_ptr<float>(), in_features, at::get_num_threads());
    TORCH_CHECK(status == 0, "quantlab native dequantize failed with status ", status);
    return out;
}

at::Tensor linear_below_autograd(const at::Tensor &x, Optional bias, const at::Tensor &codes, Optional scale,
                                 Optional zero, Optional absmax_codes, Optional absmax_scale, Optional absmax_offset,
                                 int64_t kind, int64_t bits, int64_t in_features, int64_t group_size,
                                 int64_t absmax_block, double zero_const) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("quantlab::linear", "").typed<decltype(linear)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, bias, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind, bits, in_features,
                   group_size, absmax_block, zero_const);
}

at::Tensor dequantize_op(const at::Tensor &codes, Optional scale, Optional zero, Optional absmax_codes,
                         Optional absmax_scale, Optional absmax_offset, int64_t kind, int64_t bits, int64_t in_features,
                         int64_t group_size, int64_t absmax_block, double zero_const) {
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("quantlab::dequantize", "").typed<decltype(dequantize)>();
    return op.call(codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind, bits, in_features, group_size,
                   absmax_block, zero_const);
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

// Weights above this many float32 bytes are decoded for the backward pass in tiles of output features
// of about kBackwardTileBytes, each multiplied into the input gradient as soon as it is decoded: the
// decoded copy stays in cache and the allocator reuses it, instead of a fresh weight-sized buffer per
// call (2048x8192: 64 MiB, mostly page faults). Measured at 512 rows, 2048x8192 and 8192x2048, one
// thread: the input gradient at 0.98-1.00x the speed of fp32's `grad @ W`, 0.85x decoded whole.
// Smaller weights (every SmolLM2 layer) are decoded whole: one GEMM, the reference's exact sums.
constexpr int64_t kBackwardWholeBytes = 4 << 20;
constexpr int64_t kBackwardTileBytes = 2 << 20;

// grad @ W for the gradient with respect to x: [rows, out] -> [rows, in], float32.
at::Tensor grad_input(const at::Tensor &grad, const std::vector<at::Tensor> &saved, const std::vector<int64_t> &layout,
                      double zero_const) {
    auto weight = [&](const at::Tensor &codes, Optional scale, Optional zero, Optional absmax_codes,
                      Optional absmax_scale) {
        return dequantize_op(codes, scale, zero, absmax_codes, absmax_scale, defined_or_none(saved[5]), layout[0],
                             layout[1], layout[2], layout[3], layout[4], zero_const);
    };
    const at::Tensor &codes = saved[0];
    const int64_t out = codes.size(0), in = layout[2], groups = codes.size(1);
    at::Tensor flat = grad.to(at::kFloat).reshape({-1, out});
    if (out * in * 4 <= kBackwardWholeBytes)
        return at::mm(flat, weight(codes, defined_or_none(saved[1]), defined_or_none(saved[2]),
                                   defined_or_none(saved[3]), defined_or_none(saved[4])));
    // Whole blocks of NF4's double-quantized absmax: a tile of `align` features starts on a block.
    const int64_t align = layout[4] > 0 ? layout[4] : 4;
    int64_t tile = kBackwardTileBytes / (4 * in) / align * align;
    if (tile < align) tile = align;
    at::Tensor result;
    for (int64_t first = 0; first < out; first += tile) {
        const int64_t count = std::min(tile, out - first);
        std::optional<at::Tensor> absmax_scale;
        if (saved[4].defined()) absmax_scale = saved[4].reshape({-1}).narrow(0, first * groups / layout[4],
                                                                       (count * groups + layout[4] - 1) / layout[4]);
        at::Tensor part = weight(codes.narrow(0, first, count), feature_rows(defined_or_none(saved[1]), groups, first, count),
                                 feature_rows(defined_or_none(saved[2]), groups, first, count),
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
                              const at::Tensor &codes, Optional scale, Optional zero, Optional absmax_codes,
                              Optional absmax_scale, Optional absmax_offset, int64_t kind, int64_t bits,
                              int64_t in_features, int64_t group_size, int64_t absmax_block, double zero_const) {
        ctx->save_for_backward({codes, optional_or_undefined(scale), optional_or_undefined(zero),
                                optional_or_undefined(absmax_codes), optional_or_undefined(absmax_scale),
                                optional_or_undefined(absmax_offset)});
        ctx->saved_data["layout"] = std::vector<int64_t>{kind, bits, in_features, group_size, absmax_block};
        ctx->saved_data["zero_const"] = zero_const;
        ctx->saved_data["bias_dtype"] = bias.has_value() ? bias->scalar_type() : at::kFloat;
        return linear_below_autograd(x, bias, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind,
                                     bits, in_features, group_size, absmax_block, zero_const);
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
        torch::autograd::variable_list result(14);
        const at::Tensor &grad = grads[0];
        if (ctx->needs_input_grad(0)) {
            auto saved = ctx->get_saved_variables();
            auto layout = ctx->saved_data["layout"].toIntVector();
            at::Tensor input = grad_input(grad, saved, layout, ctx->saved_data["zero_const"].toDouble());
            std::vector<int64_t> shape(grad.sizes().begin(), grad.sizes().end());
            shape.back() = layout[2];
            result[0] = input.view(shape).to(grad.scalar_type());
        }
        if (ctx->needs_input_grad(1)) {
            at::Tensor rows = grad.reshape({-1, grad.size(-1)});
            result[1] = rows.sum(0).to(ctx->saved_data["bias_dtype"].toScalarType());
        }
        return result;
    }
};

at::Tensor linear_autograd(const at::Tensor &x, Optional bias, const at::Tensor &codes, Optional scale, Optional zero,
                           Optional absmax_codes, Optional absmax_scale, Optional absmax_offset, int64_t kind,
                           int64_t bits, int64_t in_features, int64_t group_size, int64_t absmax_block,
                           double zero_const) {
    // Without gradients (inference, decoding) skip building an autograd node: about a microsecond a call.
    if (!at::GradMode::is_enabled() || !(x.requires_grad() || (bias.has_value() && bias->requires_grad())))
        return linear_below_autograd(x, bias, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind,
                                     bits, in_features, group_size, absmax_block, zero_const);
    return LinearFunction::apply(x, bias, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind, bits,
                                 in_features, group_size, absmax_block, zero_const);
}

// linear_group runs after autograd (in compiled inference graphs): with gradients asked for it refuses
// instead of silently giving none.
at::Tensor linear_group_autograd(const at::Tensor &x, OptionalList bias, at::TensorList codes, OptionalList scale,
                                 OptionalList zero, OptionalList absmax_codes, OptionalList absmax_scale,
                                 OptionalList absmax_offset, int64_t kind, int64_t bits, int64_t in_features,
                                 int64_t group_size, int64_t absmax_block, double zero_const,
                                 int64_t activation_bits) {
    bool needs_grad = x.requires_grad();
    for (const std::optional<at::Tensor> &b : bias) needs_grad |= b.has_value() && b->requires_grad();
    TORCH_CHECK(!at::GradMode::is_enabled() || !needs_grad, "quantlab::linear_group has no gradient: call "
                "quantlab::linear per layer when training");
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("quantlab::linear_group", "")
                         .typed<decltype(linear_group)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(x, bias, codes, scale, zero, absmax_codes, absmax_scale, absmax_offset, kind, bits, in_features,
                   group_size, absmax_block, zero_const, activation_bits);
}

}  // namespace

// Called once from Python with the C library's entry points and NF4's constant tables.
extern "C" __attribute__((visibility("default"))) int quantlab_torch_ops_bind(void *gemm, void *gemm_group,
                                                                             void *dequantize_entry,
                                                                             const float *levels, const float *map) {
    gemm_fn = reinterpret_cast<GemmFn>(gemm);
    gemm_group_fn = reinterpret_cast<GemmGroupFn>(gemm_group);
    dequantize_fn = reinterpret_cast<DequantizeFn>(dequantize_entry);
    std::memcpy(nf4_levels, levels, sizeof nf4_levels);
    std::memcpy(absmax_map, map, sizeof absmax_map);
    return QL_ABI_VERSION;
}

#define WEIGHT_ARGS                                                                                                \
    "Tensor codes, Tensor? scale, Tensor? zero, Tensor? absmax_codes, Tensor? absmax_scale, Tensor? absmax_offset, " \
    "int kind, int bits, int in_features, int group_size, int absmax_block, float zero_const"

TORCH_LIBRARY(quantlab, m) {
    m.def("linear(Tensor x, Tensor? bias, " WEIGHT_ARGS ") -> Tensor");
    m.def("linear_group(Tensor x, Tensor?[] bias, Tensor[] codes, Tensor?[] scale, Tensor?[] zero, "
          "Tensor?[] absmax_codes, Tensor?[] absmax_scale, Tensor?[] absmax_offset, int kind, int bits, "
          "int in_features, int group_size, int absmax_block, float zero_const, int activation_bits=0) -> Tensor");
    m.def("dequantize(" WEIGHT_ARGS ") -> Tensor");
}

TORCH_LIBRARY_IMPL(quantlab, CPU, m) {
    m.impl("linear", &linear);
    m.impl("linear_group", &linear_group);
    m.impl("dequantize", &dequantize);
}

TORCH_LIBRARY_IMPL(quantlab, Autograd, m) {
    m.impl("linear", &linear_autograd);
    m.impl("linear_group", &linear_group_autograd);
}
