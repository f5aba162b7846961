"""Block-wise reconstruction: the training step of the `reconstruct` solver, run by the block schedule.

For each block, after its layers were solved one by one (GPTQ by default, `quantlab.solvers.reconstruct`):

1. before the block is quantized, record the outputs it must reproduce (`prepare`): by default the
   float model's own hidden states (the float block on the float model's inputs, carried from block
   to block), as AutoRound and OmniQuant do, so a block also corrects the error its quantized inputs
   bring from earlier blocks; or the float block on the quantized model's inputs (`target:
   "float_block"`, what GPTQ matches layer by layer);
2. swap each quantized layer for a `FakeQuantLinear` on its own storage layout starting from the
   solver's codes, and train the rounding offsets, scales and zero points of all of them at once
   (Adam, or signed gradient descent; step sizes decaying linearly to 0) on the block's output error
   (each token's squared error relative to its target's mean square, by default), each step on
   `batch_size` calibration windows taken in a seeded order;
3. keep the step whose mini-batch error, relative to the start's error on the same windows, was the
   lowest; keep the start instead when that step is not better on all calibration windows; store
   the codes and grids in the quantized layers (what the fake quantizer computed, bit for bit).

Memory: on top of the block schedule's, the targets (one copy of `samples x seq_len x hidden`
floats; the float model's hidden states are that copy), one copy of the block's float weights, the
trained numbers with their optimizer state and best snapshot (a few times the block's weights),
and the activations autograd keeps for one mini-batch through one block.
"""

import dataclasses
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from quantlab.calibration.blocks import BlockInputs, run_block, run_block_on_batches
from quantlab.config import QuantlabConfig
from quantlab.errors import QuantizationError
from quantlab.nn import QuantizedLinear
from quantlab.nn.fake_quant import FakeQuantizedWeight, FakeQuantLinear, weights_computed_once
from quantlab.solvers.reconstruct import ReconstructOptions
from quantlab.utils.allocator import heap_for_temporaries

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BlockResult:
    """One block's output error (the training loss, over all calibration windows) before and after training."""

    start_error: float
    final_error: float
    best_step: int | None  # None: the start was kept


class BlockReconstruction:
    """The state the reconstruction carries from block to block (the float model's hidden states)."""

    def __init__(self, options: ReconstructOptions, batches: list[BlockInputs]) -> None:
        self.options = options
        self.float_hidden = [batch.hidden for batch in batches] if options.target == "float_model" else None
        self.results: list[BlockResult] = []
        self._targets: list[torch.Tensor] = []
        self._float_weights: dict[str, torch.Tensor] = {}

    @classmethod
    def for_config(cls, config: QuantlabConfig, batches: list[BlockInputs]) -> "BlockReconstruction | None":
        """The reconstruction of `config`'s solver, or None when it solves layer by layer only."""
        if not config.solver_object.refines_blocks:
            return None
        return cls(ReconstructOptions.parse(config.solver_options), batches)

    @torch.no_grad()
    def skip(self, block: nn.Module, batches: list[BlockInputs], resumed: bool = False) -> None:
        """A block with nothing to quantize: only the float model's hidden states move on through it.

        `resumed`: the block was quantized by an interrupted run; its float weights are gone, so
        targets taken from the float model's own hidden states cannot be rebuilt."""
        if self.float_hidden is not None and resumed:
            raise QuantizationError(
                "--resume cannot continue a reconstruction whose targets follow the float model's hidden states "
                '(solver option target="float_model"); rerun without --resume'
            )
        if self.float_hidden is not None:
            self.float_hidden = _float_outputs(block, self.float_hidden, batches)

    @torch.no_grad()
    def prepare(self, block: nn.Module, names: dict[str, str], batches: list[BlockInputs]) -> None:
        """Record the block's targets and the float weights of its layers `names`, before they are quantized."""
        if self.float_hidden is not None:
            self.float_hidden = _float_outputs(block, self.float_hidden, batches)
            self._targets = self.float_hidden
        else:
            self._targets = [run_block(block, batch) for batch in batches]
        self._float_weights = {name: block.get_submodule(name).weight.detach().clone() for name in names}

    def refine(
        self,
        block: nn.Module,
        layers: dict[str, QuantizedLinear],
        batches: list[BlockInputs],
        progress: bool = True,
        label: str = "block",
    ) -> list[torch.Tensor]:
        """Train the quantized `layers` (relative name → layer) of `block` on its targets and store the result
        in them (and their dequantized weights in the block's float Linear layers); returns the block's
        outputs on `batches` with those weights: the next block's inputs."""
        quantizers = {
            name: FakeQuantizedWeight.from_solution(
                layer.layout,
                layer.stored_space(self._float_weights[name]),
                layer.stored_tensors(),
                self.options.max_offset,
                self.options.learn_scales,
            )
            for name, layer in layers.items()
        }
        rotations = {name: layer.input_rotation for name, layer in layers.items()}
        with _frozen(block), _swapped(block, quantizers, rotations):
            result, outputs = _Training(block, quantizers, batches, self._targets, self.options).run(progress, label)
        with torch.no_grad():
            for name, layer in layers.items():
                layer.load_stored(quantizers[name].stored())
                linear = block.get_submodule(name)
                linear.weight.copy_(layer.dequantize_weight(linear.weight.dtype))
        self._targets, self._float_weights = [], {}
        self.results.append(result)
        logger.info(
            "%s: block output error %.4g -> %.4g (%s)",
            label,
            result.start_error,
            result.final_error,
            "start kept" if result.best_step is None else f"step {result.best_step}",
        )
        return outputs


class _Training:
    """One block's training loop over its calibration windows."""

    def __init__(
        self,
        block: nn.Module,
        quantizers: dict[str, FakeQuantizedWeight],
        batches: list[BlockInputs],
        targets: list[torch.Tensor],
        options: ReconstructOptions,
    ) -> None:
        self.block, self.quantizers, self.batches, self.targets = block, quantizers, batches, targets
        self.options = options
        trained = [(name, p) for q in quantizers.values() for name, p in q.named_parameters() if p.requires_grad]
        self.groups = [  # offsets and zero points are in grid steps, scales in ratios: each its step size
            {"params": [p for name, p in trained if name != "scale_ratio"], "lr": options.lr},
            {"params": [p for name, p in trained if name == "scale_ratio"], "lr": options.scale_lr},
        ]

    def run(self, progress: bool, label: str) -> tuple[BlockResult, list[torch.Tensor]]:
        """Train; the result, and the block's outputs with the trained numbers kept."""
        options = self.options
        start = self._snapshot()
        start_errors, _ = self._pass(keep_outputs=False)
        best, best_ratio = None, 1.0
        optimizer = _optimizer(options, self.groups)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / max(options.steps, 1))
        order = _window_order(self.batches, options.steps * options.batch_size, options.seed)
        bar = tqdm(range(options.steps), desc=f"{label} reconstruction", leave=False, disable=not progress)
        with heap_for_temporaries():  # each step's activations and gradients reuse warm heap pages
            for step in bar:
                windows = [next(order) for _ in range(options.batch_size)]
                optimizer.zero_grad(set_to_none=True)
                error = self._step_error(windows)
                ratio = error / max(sum(float(start_errors[b][w]) for b, w in windows), 1e-30)
                if ratio < best_ratio:
                    best, best_ratio = (step, self._snapshot()), ratio
                optimizer.step()
                schedule.step()
                for quantizer in self.quantizers.values():
                    quantizer.project()
                bar.set_postfix(error=f"{ratio:.3f}x start", best=f"{best_ratio:.3f}x")
        start_error = _mean(start_errors)
        if best is not None:
            self._restore(best[1])
            errors, outputs = self._pass(keep_outputs=True)
            if _mean(errors) < start_error:
                return BlockResult(start_error, _mean(errors), best[0]), outputs
        self._restore(start)
        _, outputs = self._pass(keep_outputs=True)
        return BlockResult(start_error, start_error, None), outputs

    def _step_error(self, windows: list[tuple[int, int]]) -> float:
        """Backpropagate the output error of the windows (`_token_errors`); returns the sum of their means.

        The windows go through the block as one batch (one forward and backward over all their tokens:
        larger products, less per-call work), or batch by batch when their keyword arguments cannot be
        merged."""
        by_batch: dict[int, list[int]] = {}
        for batch, window in windows:
            by_batch.setdefault(batch, []).append(window)
        parts = [(self.batches[batch], self.targets[batch], chosen) for batch, chosen in by_batch.items()]
        merged = _merged(parts)
        groups = (
            [merged]
            if merged is not None
            else [(_select(inputs, chosen), target[chosen]) for inputs, target, chosen in parts]
        )
        tokens = len(windows) * self.targets[0][0].shape[0]
        total, loss = 0.0, 0.0
        with torch.enable_grad(), weights_computed_once(self.block):
            for inputs, target in groups:
                errors = _token_errors(_block_output(self.block, inputs), target, self.options.loss)
                loss = loss + errors.sum() / tokens
                total += float(errors.detach().mean(dim=1).sum())
            loss.backward()
        return total

    @torch.no_grad()
    def _pass(self, keep_outputs: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The mean output error (`_token_errors`) of each window, per batch, and the outputs when asked for."""
        errors: list[torch.Tensor] = []

        def measure(index: int, output: torch.Tensor) -> None:
            errors.append(_token_errors(output, self.targets[index], self.options.loss).mean(dim=1))

        with weights_computed_once(self.block):  # the weights decoded once for all batches
            outputs = run_block_on_batches(self.block, self.batches, keep=keep_outputs, each=measure)
        return errors, outputs

    def _snapshot(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: quantizer.snapshot() for name, quantizer in self.quantizers.items()}

    def _restore(self, snapshot: dict[str, dict[str, torch.Tensor]]) -> None:
        for name, quantizer in self.quantizers.items():
            quantizer.restore(snapshot[name])


class SignSGD(torch.optim.Optimizer):
    """`p -= lr * sign(grad)`, AutoRound's optimizer: each number moves by the step size, whatever its gradient."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.add_(parameter.grad.sign(), alpha=-group["lr"])


def _optimizer(options: ReconstructOptions, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The optimizer over the offsets' and the grids' parameter groups (each with its step size)."""
    groups = [group for group in groups if group["params"]]
    if options.optimizer == "adam":
        return torch.optim.Adam(groups, lr=options.lr, fused=True)  # one pass over each tensor a step
    return SignSGD(groups, lr=options.lr)


def _window_order(batches: list[BlockInputs], count: int, seed: int) -> Iterator[tuple[int, int]]:
    """`(batch, window)` pairs: every calibration window once per pass, passes in fresh seeded orders."""
    windows = [(b, w) for b, batch in enumerate(batches) for w in range(batch.hidden.shape[0])]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(math.ceil(count / len(windows)) if windows else 0):
        for index in torch.randperm(len(windows), generator=generator).tolist():
            yield windows[index]


def _select(inputs: BlockInputs, windows: list[int]) -> BlockInputs:
    """Some windows of a batch, with the keyword arguments that have one row per window cut alike."""
    rows = inputs.hidden.shape[0]
    index = torch.tensor(windows)

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows and rows > 1:
            return value.index_select(0, index)
        if isinstance(value, tuple | list):
            return type(value)(cut(item) for item in value)
        if isinstance(value, dict):
            return {key: cut(item) for key, item in value.items()}
        return value

    return BlockInputs(inputs.hidden.index_select(0, index), {key: cut(v) for key, v in inputs.kwargs.items()})


class _Unmergeable(Exception):
    """Batches whose keyword arguments differ other than window by window."""


def _merged(parts: list[tuple[BlockInputs, torch.Tensor, list[int]]]) -> tuple[BlockInputs, torch.Tensor] | None:
    """The chosen windows of several batches (`(inputs, targets, windows)`) as one batch and its targets; None
    when a keyword argument neither has one row per window (`_select`'s rule) nor is the same in every batch."""
    cuts = [(inputs.hidden.shape[0], torch.tensor(chosen)) for inputs, _, chosen in parts]
    try:
        kwargs = _merge_values([inputs.kwargs for inputs, _, _ in parts], cuts)
    except _Unmergeable:
        return None
    hidden = torch.cat(
        [inputs.hidden.index_select(0, index) for (inputs, _, _), (_, index) in zip(parts, cuts, strict=True)]
    )
    targets = torch.cat([target.index_select(0, index) for (_, target, _), (_, index) in zip(parts, cuts, strict=True)])
    return BlockInputs(hidden, kwargs), targets


def _merge_values(values: list[Any], cuts: list[tuple[int, torch.Tensor]]) -> Any:
    """One keyword argument of each batch → the merged batch's (`_merged`)."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(value, torch.Tensor) for value in values):
            raise _Unmergeable
        per_window = any(
            rows > 1 and value.dim() > 0 and value.shape[0] == rows
            for value, (rows, _) in zip(values, cuts, strict=True)
        )
        if per_window:
            if not all(
                value.dim() > 0 and value.shape[0] == rows for value, (rows, _) in zip(values, cuts, strict=True)
            ):
                raise _Unmergeable
            return torch.cat([value.index_select(0, index) for value, (_, index) in zip(values, cuts, strict=True)])
        if not all(value is first or (value.shape == first.shape and torch.equal(value, first)) for value in values):
            raise _Unmergeable
        return first
    if isinstance(first, tuple | list):
        if not all(type(value) is type(first) and len(value) == len(first) for value in values):
            raise _Unmergeable
        return type(first)(_merge_values([value[i] for value in values], cuts) for i in range(len(first)))
    if isinstance(first, dict):
        if not all(isinstance(value, dict) and value.keys() == first.keys() for value in values):
            raise _Unmergeable
        return {key: _merge_values([value[key] for value in values], cuts) for key in first}
    if not all(value is first or value == first for value in values):
        raise _Unmergeable
    return first


def _token_errors(output: torch.Tensor, target: torch.Tensor, loss: str) -> torch.Tensor:
    """Each token's squared output error `[windows, tokens]`, averaged over the hidden size; with `loss`
    "relative" divided by the target token's mean square, so every token counts alike (the next block
    reads each token through an RMS or layer norm, blind to its scale). A transformer's residual stream
    carries "massive activations" (Sun et al. 2024, arXiv 2402.17762): a few tokens, the first above all,
    whose mean square is orders of magnitude above the others', so the plain squared error measures
    little but those tokens (benchmarks/RESULTS.md has SmolLM2's figures)."""
    squared = (output - target).square().flatten(2).mean(dim=-1)
    if loss == "mse":
        return squared
    return squared / target.detach().square().flatten(2).mean(dim=-1).clamp(min=1e-12)


def _block_output(block: nn.Module, inputs: BlockInputs) -> torch.Tensor:
    """The block's output hidden states, differentiable (`run_block` computes them without autograd)."""
    output = block(inputs.hidden, **inputs.kwargs)
    return output[0] if isinstance(output, tuple | list) else output


def _float_outputs(block: nn.Module, hidden: list[torch.Tensor], batches: list[BlockInputs]) -> list[torch.Tensor]:
    return run_block_on_batches(block, [BlockInputs(h, batch.kwargs) for h, batch in zip(hidden, batches, strict=True)])


def _mean(errors: list[torch.Tensor]) -> float:
    return float(torch.cat(errors).mean())


class _frozen:
    """The block's own parameters out of autograd while its quantizers train (restored after)."""

    def __init__(self, block: nn.Module) -> None:
        self.flags = [(p, p.requires_grad) for p in block.parameters()]

    def __enter__(self) -> None:
        for parameter, _ in self.flags:
            parameter.requires_grad_(False)

    def __exit__(self, *exc: Any) -> None:
        for parameter, flag in self.flags:
            parameter.requires_grad_(flag)


class _swapped:
    """Each named Linear layer of the block replaced by a `FakeQuantLinear` on its quantizer (put back after)."""

    def __init__(self, block: nn.Module, quantizers: dict[str, FakeQuantizedWeight], rotations: dict[str, int]) -> None:
        self.block = block
        self.originals = {name: block.get_submodule(name) for name in quantizers}
        self.replacements = {
            name: FakeQuantLinear(q, self.originals[name].bias, rotations[name]) for name, q in quantizers.items()
        }

    def __enter__(self) -> None:
        for name, module in self.replacements.items():
            self.block.set_submodule(name, module)

    def __exit__(self, *exc: Any) -> None:
        for name, module in self.originals.items():
            self.block.set_submodule(name, module)
