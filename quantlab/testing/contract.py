"""The contract every quantization method passes, built-in or plugin.

Subclass `MethodContract` in a test module, named `Test...`, and list the configs to check
with the signal-to-quantization-noise floor each must reach on Gaussian weights:

    class TestMyMethod(MethodContract):
        cases = [(MyConfig(bits=4), 18.0), (MyConfig(bits=2), 5.0)]

pytest then runs every check below once per case. The transformers checks share one tiny Llama
checkpoint per case (quantized while loading, then saved, once per test class), and one fresh
process per class reloads every case's checkpoint, so a method's cost grows by a save and a load
per case, not by a model build and an interpreter start per check.
"""

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM

from quantlab.config import QuantlabConfig
from quantlab.convert import quantize
from quantlab.errors import ConfigError, QuantizationError
from quantlab.registry import get_method, list_methods
from quantlab.replacement import quantized_layers
from quantlab.solvers import InputStats, get_solver, list_solvers
from quantlab.testing.models import tiny_bert, tiny_llama
from quantlab.testing.similarity import sqnr

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# The child of `fresh_process_reloads`: it never imports quantlab (transformers' import triggers the
# autoload hook), reloads each case's checkpoint, and reports per case whether its logits are the
# ones the test process computed.
_RELOAD_CHILD = """
import json, sys, traceback
import torch
from transformers import AutoModelForCausalLM

results = {}
for case in json.loads(sys.argv[1]):
    try:
        expected = torch.load(case["expected"], weights_only=True)
        model = AutoModelForCausalLM.from_pretrained(case["checkpoint"])
        with torch.no_grad():
            same = torch.equal(model(expected["tokens"]).logits, expected["logits"])
        results[case["id"]] = "same logits" if same else "different logits"
    except Exception:
        results[case["id"]] = traceback.format_exc()[-2000:]
print(json.dumps(results))
"""


@dataclasses.dataclass
class SavedCase:
    """One case's tiny Llama: the float model and folder it was loaded from, the model quantized while
    loading, and the folder that model was saved to. Shared by the checks of a class: read, never modify."""

    float_model: nn.Module
    float_dir: Path
    model: nn.Module
    quantized_dir: Path


def _case_id(case: tuple[QuantlabConfig, float]) -> str:
    config = case[0]
    options = "-".join(
        f"{name}={getattr(config, name)}" for name in config.option_names() if name != "modules_to_not_convert"
    )
    return f"{config.method}[{options}]"


class MethodContract:
    """Behaviour shared by all methods; subclasses set `cases`."""

    cases: ClassVar[list[tuple[QuantlabConfig, float]]] = []

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "case" in metafunc.fixturenames:
            metafunc.parametrize("case", self.cases, ids=[_case_id(case) for case in self.cases])

    # -- shared checkpoints -----------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def saved(cls, tmp_path_factory: pytest.TempPathFactory) -> Callable[[tuple], SavedCase]:
        """`saved(case)`: the case's checkpoint, quantized on load and saved on first use."""
        root = tmp_path_factory.mktemp(cls.__name__)
        float_model = tiny_llama()
        float_dir = root / "float"
        float_model.save_pretrained(float_dir)
        built: dict[str, SavedCase] = {}

        def get(case: tuple) -> SavedCase:
            key = _case_id(case)
            if key not in built:
                model = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=case[0])
                quantized_dir = root / f"quantized-{len(built)}"
                model.save_pretrained(quantized_dir)
                built[key] = SavedCase(float_model, float_dir, model, quantized_dir)
            return built[key]

        yield get
        built.clear()

    @pytest.fixture(scope="class")
    @classmethod
    def fresh_process_reloads(cls, saved, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
        """Every case's checkpoint reloaded in one process that never imports quantlab (the autoload
        hook registers the methods): case id -> "same logits", "different logits" or the traceback."""
        folder = tmp_path_factory.mktemp(f"{cls.__name__}-fresh")
        tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
        cases = []
        for index, case in enumerate(cls.cases):
            checkpoint = saved(case)
            with torch.no_grad():
                logits = checkpoint.model(tokens).logits
            expected = folder / f"expected-{index}.pt"
            torch.save({"tokens": tokens, "logits": logits}, expected)
            cases.append({"id": _case_id(case), "checkpoint": str(checkpoint.quantized_dir), "expected": str(expected)})
        result = subprocess.run(
            [sys.executable, "-c", _RELOAD_CHILD, json.dumps(cases)], capture_output=True, text=True, cwd=folder
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    # -- registry ---------------------------------------------------------------------------

    def test_registered(self, case):
        config, _ = case
        method = get_method(config.method)
        assert config.method in list_methods()
        assert isinstance(config, method.config_class)

    def test_config_round_trips_through_dict(self, case):
        config, _ = case
        data = json.loads(json.dumps(config.to_dict()))
        assert data["quant_method"] == f"quantlab_{config.method}"
        assert "format_version" in data
        assert type(config).from_dict(data) == config

    def test_unknown_option_is_named(self, case):
        config, _ = case
        with pytest.raises(ConfigError, match="no_such_option"):
            type(config).from_options({"no_such_option": 1})

    # -- quantize / dequantize --------------------------------------------------------------

    def test_error_within_sqnr_floor(self, case):
        config, floor_db = case
        module_class = get_method(config.method).module_class
        torch.manual_seed(0)
        linear = nn.Linear(512, 96)
        nn.init.normal_(linear.weight, std=0.02)
        layer = module_class.from_linear(linear, config)
        assert sqnr(linear.weight.detach(), layer.dequantize_weight()) >= floor_db

    def test_every_solver_produces_this_format(self, case):
        """The solver axis is orthogonal to the format: each registered solver (plugins' too) fills
        this method's storage, and its output error on inputs like its calibration is no worse than
        the SQNR floor allows (GPTQ minimises output error, so it is judged on outputs)."""
        config, floor_db = case
        module_class = get_method(config.method).module_class
        torch.manual_seed(0)
        linear = nn.Linear(256, 48, bias=False)
        nn.init.normal_(linear.weight, std=0.02)
        inputs = torch.randn(1024, 256)
        stats = InputStats(256)
        stats.add(inputs[:512])
        held_out = inputs[512:]
        for name in list_solvers():
            solver = get_solver(name)
            layout = module_class.layout_for(256, 48, config)
            if solver.unsupported(layout):
                continue
            solved = dataclasses.replace(config, solver=name)
            layer = module_class.from_linear(linear, solved, stats=stats if solver.needs_calibration else None)
            expected = module_class.storage_spec(256, 48, solved)
            assert {n: (tuple(t.shape), t.dtype) for n, t in layer.stored_tensors().items()} == expected, name
            reference = held_out @ linear.weight.detach().T
            assert sqnr(reference, held_out @ layer.dequantize_weight().T) >= floor_db - 1.0, name

    def test_codes_are_not_float_and_not_weight_shaped(self, case):
        config, _ = case
        layer = get_method(config.method).module_class.from_linear(nn.Linear(128, 32), config)
        assert not layer.weight.is_floating_point()
        assert layer.weight.dim() == 3, "codes must never load into a float Linear by accident"
        assert not any(buffer.requires_grad for buffer in layer.buffers())

    def test_stored_tensors_round_trip_bit_exactly(self, case, tmp_path):
        config, _ = case
        module_class = get_method(config.method).module_class
        torch.manual_seed(1)
        layer = module_class.from_linear(nn.Linear(192, 40), config)
        save_file({k: v.contiguous() for k, v in layer.stored_tensors().items()}, tmp_path / "layer.safetensors")
        reloaded = module_class(192, 40, True, config)
        reloaded.load_stored(load_file(tmp_path / "layer.safetensors"))
        assert torch.equal(reloaded.dequantize_weight(), layer.dequantize_weight())

    def test_nan_weight_names_the_layer(self, case):
        config, _ = case
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        with torch.no_grad():
            model[2].weight[0, 0] = float("nan")
        with pytest.raises(QuantizationError, match=r"^2: .*NaN"):
            quantize(model, config)

    def test_rejects_non_linear_target(self, case):
        config, _ = case
        model = nn.Sequential(nn.Linear(64, 64), nn.Conv1d(4, 4, 3))
        with pytest.raises(QuantizationError, match="Conv1d"):
            quantize(model, config, modules=["1"])

    def test_quantize_plain_module_and_dequantize(self, case):
        config, _ = case
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 32))
        x = torch.randn(4, 128)
        expected = model(x)
        quantize(model, config)
        assert len(quantized_layers(model)) == 2
        out = model(x)
        assert sqnr(expected, out) >= 0.5 * case[1] - 3
        weights = [layer.dequantize_weight() for layer in quantized_layers(model).values()]
        from quantlab.convert import dequantize

        dequantize(model)
        assert not quantized_layers(model)
        assert torch.equal(model[0].weight, weights[0])

    # -- transformers -----------------------------------------------------------------------

    def test_from_pretrained_tiny_llama(self, case, saved):
        config, floor_db = case
        checkpoint = saved(case)
        layers = quantized_layers(checkpoint.model)
        assert sorted({name.rsplit(".", 1)[1] for name in layers}) == sorted(LLAMA_LINEARS)
        assert len(layers) == 2 * len(LLAMA_LINEARS)
        assert type(checkpoint.model.lm_head) is nn.Linear, "the output head stays in float by default"
        tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected, logits = checkpoint.float_model(tokens).logits, checkpoint.model(tokens).logits
            converted = quantize(tiny_llama(), config)(tokens).logits
        assert torch.equal(logits, converted), "quantize-on-load and quantlab.quantize must agree"
        assert sqnr(expected, logits) >= 0.5 * floor_db - 3

    def test_from_pretrained_tiny_bert(self, case, tmp_path):
        config, floor_db = case
        float_model = tiny_bert()
        float_model.save_pretrained(tmp_path / "float")
        model = AutoModel.from_pretrained(tmp_path / "float", quantization_config=config)
        encoder_layers = [name for name in quantized_layers(model) if name.startswith("encoder.")]
        assert len(encoder_layers) == 2 * 6
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = float_model(tokens).last_hidden_state
            hidden = model(tokens).last_hidden_state
        assert sqnr(expected, hidden) >= 0.5 * floor_db - 3

    def test_save_and_reload_is_bit_identical(self, case, saved):
        config, _ = case
        checkpoint = saved(case)
        stored = json.loads((checkpoint.quantized_dir / "config.json").read_text())["quantization_config"]
        assert stored["quant_method"] == config.quant_method and stored["format_version"] >= 1
        reloaded = AutoModelForCausalLM.from_pretrained(checkpoint.quantized_dir)
        tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            assert torch.equal(reloaded(tokens).logits, checkpoint.model(tokens).logits)

    @pytest.mark.subprocess
    def test_reload_in_fresh_process_without_import(self, case, fresh_process_reloads):
        """A process that never imports quantlab loads the checkpoint correctly (autoload hook)."""
        outcome = fresh_process_reloads[_case_id(case)]
        assert outcome == "same logits", outcome

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
    def test_activation_dtypes(self, case, dtype, saved):
        config, floor_db = case
        checkpoint = saved(case)
        if dtype == torch.float32:  # the shared checkpoint's model is this load
            model = checkpoint.model
        else:
            model = AutoModelForCausalLM.from_pretrained(checkpoint.float_dir, quantization_config=config, dtype=dtype)
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits = model(tokens).logits
            expected = checkpoint.float_model(tokens).logits
        assert logits.dtype == dtype
        assert torch.isfinite(logits).all()
        assert sqnr(expected, logits.float()) >= min(0.5 * floor_db - 3, 20.0)

    def test_backward_reaches_inputs_not_codes(self, case):
        config, _ = case
        layer = get_method(config.method).module_class.from_linear(nn.Linear(64, 32), config)
        x = torch.randn(3, 64, requires_grad=True)
        layer(x).sum().backward()
        expected = torch.ones(3, 32) @ layer.dequantize_weight()
        torch.testing.assert_close(x.grad, expected)
        assert layer.bias.grad is not None


def assert_method_available(name: str) -> None:
    """For plugin suites: fail early with a clear message when the entry point is not installed."""
    if name not in list_methods():
        raise AssertionError(f"method {name!r} is not registered; is its package installed (pip install -e ...)?")


__all__ = ["MethodContract", "SavedCase", "assert_method_available"]
