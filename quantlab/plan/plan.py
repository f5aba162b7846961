"""`QuantizationPlan`: what quantizing a model with a config will do, decided before any work.

A plan is built once from a model (loaded, or on the meta device: nothing in it reads a weight)
and a config by `quantlab.plan.build_plan`: the layers to quantize with each one's resolved
config and storage layout, the solver object, whether calibration is needed and on which text,
the data-free config for the layers the calibrated schedule does not reach, the vocabulary
tables `embedding_bits` quantizes, and every weight left in float with the reason. The three
executors (`quantlab.quantize`, the transformers quantizer, the streamed quantization) run it;
`quantlab quantize --plan` prints it; the quantize report stores `to_dict()`.
"""

import dataclasses
import warnings
from typing import Any

from quantlab.config import QuantlabConfig
from quantlab.errors import LeftInFloatWarning, PaddedGroupsWarning
from quantlab.formats.layout import StorageLayout
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_experts import unrotated
from quantlab.solvers import Solver


@dataclasses.dataclass(frozen=True)
class PlannedLayer:
    """One layer the plan quantizes."""

    name: str
    in_features: int
    out_features: int
    config: QuantlabConfig  # the layer's own (layer_options and rotation applied)
    layout: StorageLayout | None  # None: the method's layer declares no layout
    calibrated: bool  # solved by the calibrated block schedule (else by the data-free config)
    solver: str  # the solver that chooses its codes (the run's, or the data-free one outside the blocks)
    allocated: bool = False  # mixed precision chooses its width and group after measuring
    experts: int = 0  # a fused experts projection: this many `[out, in]` slices, each stored like a Linear layer

    @classmethod
    def make(
        cls,
        name: str,
        in_features: int,
        out_features: int,
        config: QuantlabConfig,
        module_class: type[QuantizedLinear],
        calibrated: bool,
        experts: int = 0,
    ) -> "PlannedLayer":
        """The layer `name` under the run's `config` (its layer options and rotation applied; an experts
        projection is never rotated)."""
        layer_config = unrotated(config.config_for(name)) if experts else config.config_for(name)
        try:
            layout = module_class.layout_for(in_features, out_features, layer_config)
        except NotImplementedError:
            layout = None
        allocated = config.target_bits is not None and name not in (config.layer_options or {})
        solver = config.solver if calibrated else data_free_config(config).solver
        return cls(name, in_features, out_features, layer_config, layout, calibrated, solver, allocated, experts)

    @property
    def weights(self) -> int:
        return self.in_features * self.out_features * max(self.experts, 1)

    @property
    def padded(self) -> tuple[int, int, int] | None:
        """(inputs, group size, codes stored a row) when the group size does not divide the inputs."""
        if self.layout is None:
            return None
        stored = self.layout.groups * self.layout.group_length
        return None if stored == self.in_features else (self.in_features, self.layout.group_length, stored)


@dataclasses.dataclass(frozen=True)
class FloatWeight:
    """A weight of two or more dimensions the plan leaves in float, and why."""

    name: str
    shape: tuple[int, ...]
    why: str
    chosen: bool  # kept on purpose (skipped, the default head, an embedding table); False: nothing handles it
    vocabulary: bool = False  # an input embedding table or the output head

    @property
    def weights(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclasses.dataclass
class QuantizationPlan:
    """What quantizing with `config` does to one model (see the module docstring)."""

    config: QuantlabConfig
    module_class: type[QuantizedLinear]
    solver: Solver
    layers: dict[str, PlannedLayer]
    tables: list[str] = dataclasses.field(default_factory=list)  # vocabulary tables `embedding_bits` quantizes
    left_float: list[FloatWeight] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)  # the skip list the selection applied
    calibration: str | None = None  # the calibration data, described; None: data-free
    # Expert slices quantized by the data-free solver after calibration (name -> why), filled while calibrating
    data_free_experts: dict[str, str] = dataclasses.field(default_factory=dict)

    # -- what the executors ask ------------------------------------------------------------

    def selects(self, name: str) -> bool:
        """Whether the Linear layer `name` is one the plan quantizes: a Linear layer, or one expert's slice
        `{projection}.{expert}` of a planned experts projection (a Linear while its block is calibrated)."""
        layer = self.layers.get(name)
        if layer is not None:
            return not layer.experts
        return self._expert_projection(name) is not None

    def config_for(self, name: str) -> QuantlabConfig:
        """The config of the layer (or expert slice) `name`, as planned (after mixed precision: as chosen)."""
        layer = self.layers.get(name) or self._expert_projection(name)
        return layer.config if layer is not None else self.config.config_for(name)

    def data_free_for(self, name: str) -> QuantlabConfig:
        """The data-free config of the layer (or experts projection) `name`."""
        return data_free_config(self.config_for(name))

    def note_data_free_experts(self, routed: dict[str, int], needed: int) -> None:
        """Record expert slices quantized data-free because they received `routed[name]` tokens (< `needed`)."""
        solver = self.data_free.solver
        for name, tokens in routed.items():
            self.data_free_experts[name] = f"{tokens} calibration tokens routed (fewer than {needed}): {solver}"

    def _expert_projection(self, name: str) -> PlannedLayer | None:
        parent, _, index = name.rpartition(".")
        layer = self.layers.get(parent)
        if layer is None or not layer.experts or not index.isdigit() or int(index) >= layer.experts:
            return None
        return layer

    @property
    def experts_modules(self) -> list[str]:
        """The fused experts modules the plan quantizes (each holds two planned projections)."""
        return list(dict.fromkeys(name.rpartition(".")[0] for name, layer in self.layers.items() if layer.experts))

    @property
    def needs_calibration(self) -> bool:
        return self.config.needs_calibration

    @property
    def calibrates_blocks(self) -> bool:
        """Whether the blocks are quantized by the calibrated schedule (a calibrated solver, or AWQ's scaling)."""
        return calibrates_blocks(self.config)

    @property
    def data_free(self) -> QuantlabConfig:
        """The config of the layers quantized without statistics (after mixed precision: with its choices)."""
        return data_free_config(self.config)

    def set_layer_options(self, layer_options: dict[str, dict[str, Any]] | None) -> None:
        """Mixed precision's choices, made after measuring: the config and every layer's entry follow them."""
        self.config.layer_options = layer_options
        self.layers = {
            name: PlannedLayer.make(
                name,
                layer.in_features,
                layer.out_features,
                self.config,
                self.module_class,
                layer.calibrated,
                layer.experts,
            )
            for name, layer in self.layers.items()
        }

    @property
    def allocates(self) -> bool:
        """Mixed precision: each layer's width and group are chosen after measuring (`target_bits`)."""
        return self.config.target_bits is not None

    # -- what it says ------------------------------------------------------------------------

    def padded_layers(self) -> dict[str, tuple[int, int, int]]:
        return {name: layer.padded for name, layer in self.layers.items() if layer.padded is not None}

    def unhandled(self) -> list[FloatWeight]:
        """Weights left in float because no quantized module handles their kind."""
        return [weight for weight in self.left_float if not weight.chosen]

    def quantized_share(self) -> float:
        """The share of the weights outside the vocabulary (input embeddings, output head) that the plan
        quantizes."""
        quantized = sum(layer.weights for layer in self.layers.values())
        floating = sum(weight.weights for weight in self.left_float if not weight.vocabulary)
        total = quantized + floating
        return quantized / total if total else 0.0

    def warn(self) -> None:
        """One warning line each for padded groups and for weights nothing could quantize."""
        padded = self.padded_layers()
        if padded:
            name, (inputs, group, stored) = next(iter(padded.items()))
            more = f" and {len(padded) - 1} more layer(s)" if len(padded) > 1 else ""
            fits = [size for size in (32, 64, 128, 256) if inputs % size == 0]
            hint = f"groups of {', '.join(map(str, fits))} divide {inputs}" if fits else "a smaller group divides it"
            warnings.warn(
                f"{self.config.method}: {name}{more} pad their last group: {inputs} inputs in groups of {group} "
                f"store {stored} codes a row (+{100 * (stored - inputs) / inputs:.0f} %); {hint}",
                PaddedGroupsWarning,
                stacklevel=3,
            )
        unhandled = self.unhandled()
        if unhandled:
            weights = sum(weight.weights for weight in unhandled)
            warnings.warn(
                f"{self.config.method}: {len(unhandled)} weight(s) stay in float because no quantized module handles "
                f"their kind ({unhandled[0].name}: {unhandled[0].why}; {weights:,} weights); "
                f"{100 * self.quantized_share():.1f} % of the weights outside the vocabulary are quantized",
                LeftInFloatWarning,
                stacklevel=3,
            )

    def describe(self) -> str:
        """The plan as text: one line per layer (format, width, group, solver), then what stays in float."""
        from quantlab.plan.describe import describe_plan

        return describe_plan(self)

    def to_dict(self) -> dict[str, Any]:
        """The plan as saved in the quantize report."""
        return {
            "solver": self.solver.name,
            "calibration": self.calibration,
            "data_free_solver": self.data_free.solver,
            "layers": {name: _layer_dict(layer) for name, layer in self.layers.items()},
            "tables": list(self.tables),
            "left_float": [
                {"name": w.name, "shape": list(w.shape), "why": w.why, "chosen": w.chosen} for w in self.left_float
            ],
            "quantized_share": self.quantized_share(),
            "data_free_experts": dict(self.data_free_experts),
        }


def calibrates_blocks(config: QuantlabConfig) -> bool:
    """Whether `config` quantizes the blocks by the calibrated schedule (a calibrated solver, or AWQ's scaling)."""
    return config.awq or config.solver_object.needs_calibration


def data_free_config(config: QuantlabConfig) -> QuantlabConfig:
    """The config for layers quantized without statistics: all of them under a data-free solver, and
    under a calibrated one those outside the calibrated blocks (an untied output head, a pooler),
    which get the solver's data-free substitute on the same storage format."""
    if not config.needs_calibration:
        return config
    solver = config.solver_object
    name = solver.data_free_substitute if solver.needs_calibration else solver.name
    options = config.solver_options if name == solver.name else None
    return dataclasses.replace(
        config, solver=name, solver_options=options, awq=False, target_bits=None, self_calibration=False
    )


def _layer_dict(layer: PlannedLayer) -> dict[str, Any]:
    entry: dict[str, Any] = {"shape": [layer.out_features, layer.in_features], "solver": layer.solver}
    if layer.layout is not None:
        entry.update(format=layer.layout.codec, bits=layer.layout.bits, group_size=layer.layout.group_size)
    if layer.config.input_rotated:
        entry["rotated"] = True
    if layer.allocated:
        entry["allocated"] = True
    if layer.experts:
        entry["experts"] = layer.experts
    return entry
