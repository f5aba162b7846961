"""`to_onnx`: export a float or quantlab-quantized transformers model to one ONNX file.

The model is traced by `torch.onnx.export(dynamo=True)` with each quantized layer replaced
by a placeholder node; the placeholders are then lowered to onnxruntime's low-bit operators
fed with the layers' own codes and scales (see `codec_lowerings.py` for the table). The
graph has dynamic batch and sequence axes, and optionally past key values. A mixture of
experts' quantized projections (`QuantizedExperts`) are lowered expert by expert the same way,
every expert computing every token (see `experts.py`); the router is exported as transformers
writes it.

Why the dynamo exporter: the TorchScript one (`dynamo=False`) also exports transformers 5.23
Llama with a DynamicCache, and faster, but it bakes Python branches on sizes into the
graph (its tracer warns on `q_length == 1` and `padding_length > 0` in the mask code) and is
deprecated; torch.export keeps those shapes symbolic.
"""

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir
import torch
from torch import nn

import quantlab
from quantlab.export.onnx import graph_optimizer, placeholder
from quantlab.export.onnx.errors import ExportError
from quantlab.export.onnx.expert_lowering import expert_layer, projection_names
from quantlab.export.onnx.lower_graph import lower_placeholders, operator_counts
from quantlab.export.onnx.lowering import lowering_for
from quantlab.export.onnx.saving import check_output, save_model, staged_output, stored_bytes
from quantlab.export.onnx.tracking import ModuleTracker, module_of_failed_node, short_reason
from quantlab.export.onnx.wrappers import ExportSpec, build_spec
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_embedding import QuantizedTable
from quantlab.nn.quantized_experts import PROJECTIONS, QuantizedExperts

_WRAPPER_PREFIX = "model."  # the wrappers hold the model as `self.model`
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits: unset, fp32, fp16, bf16, int8 activations


@dataclass
class OnnxExport:
    """What `to_onnx` wrote."""

    path: Path
    bytes: int
    kind: str
    with_past: bool
    input_names: list[str]
    output_names: list[str]
    operators: dict[str, int]
    layer_operators: dict[str, str] = field(default_factory=dict)
    ort_dynamic_int8: bool = False
    accuracy_level: int = 0

    def to_json(self) -> dict:
        return {
            "output": str(self.path),
            "bytes": self.bytes,
            "kind": self.kind,
            "with_past": self.with_past,
            "ort_dynamic_int8": self.ort_dynamic_int8,
            "accuracy_level": self.accuracy_level,
            "inputs": self.input_names,
            "outputs": self.output_names,
            "operators": self.operators,
            "quantized_layers": dict(Counter(self.layer_operators.values())),
        }


def to_onnx(
    model: nn.Module,
    path: str | Path,
    *,
    with_past: bool = False,
    ort_dynamic_int8: bool = False,
    accuracy_level: int = 0,
    overwrite: bool = False,
) -> OnnxExport:
    """Export `model` (a transformers causal LM or encoder, float or quantized by quantlab) to `path`.

    `with_past`: causal LMs take and return past key values, for generation (see `OnnxCausalLM`).
    `ort_dynamic_int8`: run onnxruntime's `quantize_dynamic` (int8 weights and activations)
    on the float export, for comparison; the model must then have no quantlab layers.
    `accuracy_level`: MatMulNBits' attribute. 0 (default) computes with float activations, so
    onnxruntime matches PyTorch; 4 quantizes activations to int8 per block, which onnxruntime
    1.31 needs for a fast CPU kernel at 2 and 8 bits (at 0 it dequantizes those weights on every
    call, far slower than fp32, benchmarks/RESULTS.md; 4-bit is fast either way).
    The file is written atomically; weights above ~1.8 GB go to `<path>.data`.
    """
    check_output(path, overwrite)
    if accuracy_level not in ACCURACY_LEVELS:
        raise ExportError(f"accuracy_level={accuracy_level!r} is not valid; use one of {ACCURACY_LEVELS}")
    check_exportable(model)
    if ort_dynamic_int8:
        _check_float(model)
    with _eval_mode(model):
        spec = _traced(model, "", build_spec, model, with_past)
        with placeholder.placeholders(model) as layers:
            program = _export(spec)
    layer_operators = lower_placeholders(program.model, layers, accuracy_level)
    onnx_model = program.model
    _drop_trace_metadata(onnx_model)
    for key, value in {**spec.metadata, "quantlab.version": quantlab.__version__}.items():
        onnx_model.metadata_props[key] = value
    with staged_output(path, overwrite) as staged:
        operators = _write(onnx_model, staged, ort_dynamic_int8)
    path = Path(path)
    return OnnxExport(
        path=path,
        bytes=stored_bytes(path),
        kind=spec.kind,
        with_past=with_past,
        input_names=spec.input_names,
        output_names=spec.output_names,
        operators=dict(sorted(operators.items())),
        layer_operators=layer_operators,
        ort_dynamic_int8=ort_dynamic_int8,
        accuracy_level=accuracy_level,
    )


def _write(model: ir.Model, path: Path, ort_dynamic_int8: bool) -> Counter:
    """Save `model` (or onnxruntime's dynamic int8 quantization of it) to `path`; its operator counts."""
    if not ort_dynamic_int8:
        save_model(model, path)
        return operator_counts(model)
    from quantlab.export.onnx.ort_quantize import quantize_dynamic_int8  # imports onnxruntime.quantization: only here

    float_path = path.parent / ("float-" + path.name)
    save_model(model, float_path)
    quantize_dynamic_int8(float_path, path)
    return operator_counts(ir.load(path))


def check_exportable(model: nn.Module) -> None:
    """Refuse, by module name, layers the export cannot carry: quantized layers of other libraries
    and quantlab layers without an ONNX lowering."""
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            lowering_for(name, module)
            continue
        if isinstance(module, QuantizedExperts):
            for projection, projection_name in zip(PROJECTIONS, projection_names(name), strict=True):
                lowering_for(projection_name, expert_layer(module, projection, 0))
            continue
        if isinstance(module, QuantizedTable):
            continue  # traced as torch ops: a Gather of the stored codes, decoded (see nn/quantized_embedding.py)
        for tensor_name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor_name in ("weight", "bias") and not tensor.is_floating_point():
                raise ExportError(
                    f"{name}: {type(module).__name__} stores its {tensor_name} as {tensor.dtype}, a quantization "
                    f"quantlab cannot export; load the model in float, or quantize it with quantlab"
                )
            if tensor.device.type == "meta":
                raise ExportError(f"{name}: {tensor_name} is on the meta device; load the model's weights first")


def _check_float(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            raise ExportError(
                f"{name}: ort_dynamic_int8 quantizes a float export with onnxruntime, but this model is already "
                f"quantized by quantlab; export the float checkpoint instead"
            )


def _export(spec: ExportSpec) -> "torch.onnx.ONNXProgram":
    """torch.export, then ONNX translation; failures become `ExportError`s naming the module."""
    program = _traced(
        spec.wrapper,
        _WRAPPER_PREFIX,
        torch.export.export,
        spec.wrapper,
        spec.args,
        dynamic_shapes=_torch_dims(spec.dynamic_shapes),
        strict=False,
    )
    try:
        with _quiet_exporter():
            onnx_program = torch.onnx.export(
                program,
                input_names=spec.input_names,
                output_names=spec.output_names,
                dynamic_shapes=spec.dynamic_shapes,
                custom_translation_table=placeholder.TRANSLATION_TABLE,
                dynamo=True,
                optimize=False,  # graph_optimizer runs the same passes less one that costs minutes
                verbose=False,
            )
            graph_optimizer.optimize(onnx_program.model)
            return onnx_program
    except Exception as error:
        module = module_of_failed_node(program, error, prefix=_WRAPPER_PREFIX)
        where = f"{module} ({type(spec.wrapper.model.get_submodule(module)).__name__})" if module else "the model"
        raise ExportError(f"{where} cannot be converted to ONNX: {short_reason(error)}") from error


def _torch_dims(named: tuple) -> tuple:
    """torch.export takes `Dim`s; the names are given back to the ONNX axes by `torch.onnx.export`."""
    return tuple(
        _torch_dims(axes) if isinstance(axes, tuple) else {axis: torch.export.Dim.DYNAMIC for axis in axes}
        for axes in named
    )


def _traced(root: nn.Module, prefix: str, fn, *args, **kwargs):
    """Run `fn` while tracking `root`'s modules; an exception is re-raised naming the innermost one."""
    tracker = ModuleTracker(root, prefix=prefix)
    try:
        with tracker.active(), _quiet_exporter():
            return fn(*args, **kwargs)
    except ExportError:
        raise
    except Exception as error:
        module = tracker.innermost
        where = type(root).__name__
        if module:
            where = f"{module} ({type(root.get_submodule(prefix + module)).__name__})"
        raise ExportError(f"{where} cannot be exported: {short_reason(error)}") from error


def _drop_trace_metadata(model: ir.Model) -> None:
    """The exporter annotates every node with its Python stack and module path: megabytes on a
    small model, useful only to debug the exporter."""
    for node in model.graph:
        node.metadata_props.clear()


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Trace the inference graph (no dropout), then give every module back its own mode."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter's own deprecation and renaming chatter is not the user's business."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*The axis name.*will not be used.*")
        yield
