"""The online Hadamard rotation of a layer's input (`rotate_inputs`): the transform itself, the codes every
solver stores under it, saving and reloading, exports that run it or refuse it, adapters and training on top."""

import copy
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantlab
from quantlab.calibration.blocks import BlockInputs
from quantlab.calibration.sequential import collect_input_stats
from quantlab.errors import ConfigError
from quantlab.export import to_onnx
from quantlab.export.compressed_tensors.exporter import CompressedTensorsExportError, to_compressed_tensors
from quantlab.export.gguf.errors import GGUFExportError
from quantlab.export.gguf.exporter import to_gguf
from quantlab.nn import rotation
from quantlab.nn.rotation import hadamard, input_rotation_block, rotate, rotate_square, rotation_block
from quantlab.replacement import quantized_layers
from quantlab.solvers import InputStats
from quantlab.testing import byte_tokenizer, tiny_llama

DOWN = ["down_proj"]


def _block_matrix(width: int, block: int) -> torch.Tensor:
    return torch.block_diag(*[hadamard(block)] * (width // block))


@pytest.mark.parametrize(
    ("width", "rule", "block"),
    [
        (96, "power_of_two", 32),
        (1536, "power_of_two", 512),
        (64, "power_of_two", 64),
        (48, "power_of_two", 16),
        (2048, "power_of_two", 2048),
        (96, "largest", 96),  # 12 x 8
        (576, "largest", 576),  # 36 x 16: SmolLM2's hidden width
        (1536, "largest", 1536),  # 12 x 128: its MLP width
        (2048, "largest", 2048),
        (1600, "largest", 64),  # 25 x 64: no Hadamard order here holds the 25
    ],
)
def test_rotation_is_the_block_diagonal_hadamard_matrix_and_its_own_inverse(width, rule, block) -> None:
    assert rotation_block(width, rule) == block
    x = torch.randn(5, 3, width, dtype=torch.float64)
    matrix = _block_matrix(width, block).double()
    torch.testing.assert_close(rotate(x, block), x @ matrix)
    torch.testing.assert_close(rotate(rotate(x, block), block), x)
    h = torch.randn(width, width, dtype=torch.float64)
    h = h @ h.T
    torch.testing.assert_close(rotate_square(h, block), matrix @ h @ matrix)


@pytest.mark.parametrize("order", [*rotation.PALEY_ORDERS, 12 * 16, 36 * 4, 4, 1])
def test_every_hadamard_order_built_is_symmetric_and_orthogonal(order) -> None:
    matrix = hadamard(order, torch.float64)
    assert set(torch.unique(matrix * order**0.5).round().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(matrix, matrix.T, rtol=0, atol=0)
    torch.testing.assert_close(matrix @ matrix, torch.eye(order, dtype=torch.float64))
    left, right = rotation.factors(order)
    assert left * right == order
    torch.testing.assert_close(torch.kron(hadamard(left, torch.float64), hadamard(right, torch.float64)), matrix)


def test_sylvester_matrices_are_unchanged() -> None:
    """Power-of-two blocks (the default) are Sylvester's matrices, as they always were."""
    sylvester = torch.ones(1, 1)
    while sylvester.shape[0] < 256:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0)
    torch.testing.assert_close(hadamard(256), sylvester / 16, rtol=0, atol=0)
    assert rotation.factors(512) == (16, 32) and rotation.core_signs(512) is None
    with pytest.raises(ConfigError, match="no Hadamard matrix of order 20"):
        hadamard(20)


def test_a_rotation_first_computed_while_evaluating_still_trains() -> None:
    """`quantlab qat --eval` measures perplexity in inference mode before training: the Hadamard factors it
    caches then must not be inference tensors, which autograd refuses to save."""
    rotation._FACTORS.clear()
    with torch.inference_mode():
        rotate(torch.randn(3, 64, dtype=torch.float64), 64)
    x = torch.randn(3, 64, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(64, dtype=torch.float64)
    (rotate(x, 64) @ weights).sum().backward()
    torch.testing.assert_close(x.grad, rotate(weights.expand(3, 64), 64))  # R is symmetric: the gradient is R w


def test_rotation_blocks_of_wide_layers_and_refusals() -> None:
    assert rotation_block(28672, "power_of_two") == 4096  # a 70B model's down projection: 7 x 4096
    assert rotation_block(28672, "largest") == 14336  # 28 x 512, capped at MAX_BLOCK
    assert rotation_block(1 << 20, "largest") == 1 << 14  # capped
    assert rotation_block(72, "largest") == 72  # 36 x 2
    with pytest.raises(ConfigError, match="72 inputs would rotate blocks of 8"):
        rotation_block(72, "power_of_two")
    with pytest.raises(ConfigError, match="40 inputs would rotate blocks of 8"):
        rotation_block(40, "largest")
    with pytest.raises(ConfigError, match="rotation_blocks='whole' is not valid"):
        quantlab.CustomBitsConfig(bits=4, rotate_inputs=DOWN, rotation_blocks="whole")


def test_input_rotation_block_follows_the_layer_config() -> None:
    config = quantlab.CustomBitsConfig(bits=4, rotate_inputs=["down_proj"], rotation_blocks="largest")
    assert input_rotation_block(1536, config.config_for("model.layers.0.mlp.down_proj")) == 1536
    assert input_rotation_block(1536, config.config_for("model.layers.0.mlp.up_proj")) == 0
    assert input_rotation_block(1536, config) == 0  # the run's config names layers, it rotates none itself


def test_config_names_rotated_layers_by_suffix_prefix_or_regex() -> None:
    config = quantlab.CustomBitsConfig(bits=4, rotate_inputs=["down_proj", r"encoder\.layer\.\d+\.output\.dense"])
    assert config.config_for("model.layers.3.mlp.down_proj").input_rotated
    assert config.config_for("encoder.layer.2.output.dense").input_rotated
    assert not config.config_for("encoder.layer.2.attention.output.dense").input_rotated
    assert not config.config_for("model.layers.3.mlp.up_proj").input_rotated
    assert quantlab.CustomBitsConfig(bits=4, rotate_inputs="down_proj").rotate_inputs == DOWN
    assert "input_rotated" not in config.to_dict()  # resolved per layer, never saved
    with pytest.raises(ConfigError, match=r"rotate_inputs=.* is not valid"):
        quantlab.CustomBitsConfig(bits=4, rotate_inputs=[3])


def test_a_name_that_matches_no_layer_and_a_layer_that_cannot_rotate_are_refused() -> None:
    with pytest.raises(ConfigError, match="matches no layer this model quantizes"):
        quantlab.quantize(tiny_llama(), quantlab.CustomBitsConfig(bits=4, rotate_inputs=["dwn_proj"]))
    model = nn.Sequential(nn.Linear(40, 8))
    with pytest.raises(ConfigError, match="0: a Hadamard rotation of 40 inputs"):
        quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=None, rotate_inputs=["0"]))


@pytest.mark.parametrize(
    "config",
    [
        quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True),
        quantlab.CustomBitsConfig(bits=4, group_size=32, solver="mse"),
        quantlab.NF4Config(blocksize=32),
        quantlab.Int8SymmetricConfig(),
        quantlab.LutConfig(bits=3, group_size=32),
    ],
    ids=["cb3-rtn", "cb4-mse", "nf4", "int8", "lut3"],
)
def test_a_rotated_layer_stores_the_codes_of_the_rotated_weight_and_computes_the_float_layer(config) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    rotated_config = copy.deepcopy(config)
    rotated_config.rotate_inputs = ["layer"]
    rotated_config.rotation_blocks = "largest"
    layer = quantlab.quantize(linear, rotated_config.config_for("layer"))
    assert layer.input_rotation == 96  # 12 x 8: the whole row
    plain = nn.Linear(96, 40)
    plain.weight.data = rotate(linear.weight.detach(), 96)
    expected = quantlab.quantize(plain, config)
    for name, tensor in layer.stored_tensors().items():
        assert torch.equal(tensor, expected.stored_tensors()[name]), name
    x = torch.randn(7, 96)
    torch.testing.assert_close(layer.dequantize_weight(), rotate(expected.dequantize_weight(), 96))
    torch.testing.assert_close(layer(x), x @ layer.dequantize_weight().T + linear.bias, rtol=1e-4, atol=1e-5)
    assert "input_rotation=96" in repr(layer)
    rotated_config.rotation_blocks = "power_of_two"  # the default
    assert quantlab.quantize(copy.deepcopy(linear), rotated_config.config_for("layer")).input_rotation == 32


def test_gptq_solves_on_the_statistics_of_the_rotated_inputs() -> None:
    """GPTQ of a rotated layer gives the codes GPTQ gives `W R` when it sees the inputs `x R` themselves."""
    torch.manual_seed(1)
    linear = nn.Linear(128, 48, bias=False)
    x = torch.randn(4, 64, 128) * torch.linspace(0.1, 3.0, 128)
    config = quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True, solver="gptq", rotate_inputs=["fc"])
    stats = collect_input_stats(nn.Sequential(linear), {"0": "fc"}, [BlockInputs(x, {})])["0"]
    layer_class = type(quantlab.quantize(nn.Linear(128, 8), quantlab.CustomBitsConfig(bits=3, group_size=32)))
    rotated = layer_class.quantize_checked(linear.weight, config.config_for("fc"), "fc", stats)
    by_hand = InputStats(128)
    by_hand.add(rotate(x, 128))
    plain_config = quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True, solver="gptq")
    expected = layer_class.quantize_checked(rotate(linear.weight.detach(), 128), plain_config, "fc", by_hand)
    assert rotated.keys() == expected.keys()
    for name, tensor in rotated.items():  # the rotated Hessian differs from the one summed by float rounding
        torch.testing.assert_close(tensor, expected[name], rtol=1e-3, atol=0, msg=name)


@pytest.fixture(scope="module")
def rotated_llama():
    """A tiny Llama, 4-bit GPTQ with its down projections' inputs rotated, and the float model it came from."""
    float_model = tiny_llama(seed=2)
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, solver="gptq", rotate_inputs=DOWN)
    config.rotation_blocks = "largest"  # the MLP's 192 inputs in one block of 12 x 16
    config.calibration_samples, config.calibration_seq_len = 8, 32
    calibration = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    model = quantlab.quantize(copy.deepcopy(float_model), config, calibration=calibration, progress=False)
    return model, float_model


def test_only_the_named_layers_rotate_and_the_model_stays_close_to_float(rotated_llama) -> None:
    model, float_model = rotated_llama
    rotations = {name: layer.input_rotation for name, layer in quantized_layers(model).items()}
    assert {name for name, block in rotations.items() if block} == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        quantized, reference = model(ids).logits, float_model(ids).logits
        dequantized = quantlab.dequantize(copy.deepcopy(model))(ids).logits
    torch.testing.assert_close(dequantized, quantized, rtol=1e-4, atol=1e-4)
    assert ((quantized - reference).norm() / reference.norm()) < 0.1


def test_a_saved_rotated_model_reloads_in_a_fresh_process_with_the_same_logits(rotated_llama, tmp_path) -> None:
    import subprocess
    import sys

    model, _ = rotated_llama
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]["rotate_inputs"] == DOWN
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "import quantlab\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "assert model.model.layers[0].mlp.down_proj.input_rotation == 192\n"
        "assert model.model.layers[0].mlp.up_proj.input_rotation == 0\n"
        "ids = torch.load(sys.argv[2], weights_only=True)\n"
        "with torch.no_grad():\n"
        "    torch.save(model(ids).logits, sys.argv[3])\n"
    )
    paths = [str(tmp_path / "saved"), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")]
    subprocess.run([sys.executable, "-c", script, *paths], check=True, timeout=300)
    assert torch.equal(torch.load(tmp_path / "logits.pt", weights_only=True), expected)


def test_onnx_runs_the_rotation(rotated_llama, tmp_path) -> None:
    model, _ = rotated_llama
    export = to_onnx(model, tmp_path / "model.onnx")
    session = ort.InferenceSession(str(export.path), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    names = {i.name for i in session.get_inputs()}
    logits = session.run(["logits"], {k: v for k, v in feeds.items() if k in names})[0]
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits.numpy()
    assert np.abs(logits - expected).max() < 1e-3


def test_gguf_and_compressed_tensors_refuse_a_rotated_model_in_one_line(rotated_llama, tmp_path) -> None:
    model, _ = rotated_llama
    with pytest.raises(GGUFExportError, match=r"^model.layers.0.mlp.down_proj \(and 1 more\) rotates its input"):
        to_gguf(model, tmp_path / "model.gguf", tokenizer=byte_tokenizer())
    with pytest.raises(CompressedTensorsExportError, match="which compressed-tensors cannot express"):
        to_compressed_tensors(model, tmp_path / "ct")
    assert not (tmp_path / "model.gguf").exists() and not (tmp_path / "ct").exists()


def test_a_lora_adapter_trains_on_a_rotated_layer_and_merges_into_it(rotated_llama) -> None:
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(rotated_llama[0])
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False))
    ids = torch.randint(0, 256, (2, 8))
    loss = peft_model(ids, labels=ids).loss
    loss.backward()
    adapters = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    assert adapters and all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters)
    with torch.no_grad():
        before = peft_model(ids).logits
    merged = peft_model.merge_and_unload()
    assert merged.model.layers[0].mlp.down_proj.input_rotation == 192
    with torch.no_grad():
        after = merged(ids).logits
    assert ((after - before).norm() / before.norm()) < 0.05  # the merge requantizes: close, not equal


@pytest.mark.parametrize("native_step", [False, True], ids=["compiled", "native"])
def test_the_decode_steps_rotate_the_down_projection_input(rotated_llama, native_step) -> None:
    """The compiled step traces the rotation (its Hadamard factors made while tracing); the native step runs
    it in C (csrc/decode.c) before the down projection."""
    from quantlab.generation import compile_for_decoding
    from quantlab.kernels.cpu import native
    from quantlab.nn import rotation

    if native_step and native.library() is None:
        pytest.skip("the native CPU kernels are not built here")
    model = copy.deepcopy(rotated_llama[0])
    model.generation_config.pad_token_id = 0
    prompt = torch.tensor([[1, 5, 9, 33, 70, 2, 8]])
    options = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    options |= {"output_logits": True, "return_dict_in_generate": True}
    reference = model.generate(prompt, **options)
    rotation._FACTORS.clear()
    compile_for_decoding(model, max_cache_len=24, native_step=native_step)
    out = model.generate(prompt, **options)
    if native_step:
        assert model._compiled_call.native_steps == 7
    assert torch.equal(out.sequences, reference.sequences)
    expected = torch.stack(reference.logits)
    assert ((torch.stack(out.logits) - expected).norm() / expected.norm()) < 1e-4


def test_the_native_step_rotates_each_shared_input_once_and_refuses_a_partial_rotation() -> None:
    """Every projection rotated: q/k/v's input and gate/up's are rotated once each in C (hidden 64 in one
    Sylvester block, the MLP's 192 as 12 x 16), with the logits of the layer-by-layer model."""
    from quantlab.generation import compile_for_decoding
    from quantlab.kernels.cpu import native

    if native.library() is None:
        pytest.skip("the native CPU kernels are not built here")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, rotate_inputs=every, rotation_blocks="largest")
    model = quantlab.quantize(tiny_llama(seed=9), config)
    assert {layer.input_rotation for layer in quantized_layers(model).values()} == {64, 192}
    model.generation_config.pad_token_id = 0
    prompt = torch.tensor([[1, 5, 9, 33, 70, 2, 8]])
    options = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    options |= {"output_logits": True, "return_dict_in_generate": True}
    reference = model.generate(prompt, **options)
    compile_for_decoding(model, max_cache_len=24, native_step=True)
    out = model.generate(prompt, **options)
    assert model._compiled_call.native_steps == 5
    assert torch.equal(out.sequences, reference.sequences)
    expected = torch.stack(reference.logits)
    assert ((torch.stack(out.logits) - expected).norm() / expected.norm()) < 1e-4

    partial = quantlab.quantize(
        tiny_llama(seed=9), quantlab.CustomBitsConfig(bits=4, group_size=32, rotate_inputs=["q_proj"])
    )
    with pytest.raises(ConfigError, match=r"k_proj, .*v_proj share once, and they rotate it differently"):
        compile_for_decoding(partial, max_cache_len=24, native_step=True)


def test_reconstruction_and_grid_training_keep_the_rotation() -> None:
    from quantlab.qat import QATOptions
    from quantlab.qat.swap import fake_quantize, write_back

    config = quantlab.CustomBitsConfig(
        bits=3,
        group_size=32,
        symmetric=True,
        solver="reconstruct",
        solver_options={"steps": 4, "batch_size": 4},
        rotate_inputs=DOWN,
        calibration_samples=8,
        calibration_seq_len=32,
    )
    calibration = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(5))
    model = quantlab.quantize(tiny_llama(seed=4), config, calibration=calibration, progress=False)
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        quantized = model(ids).logits
        dequantized = quantlab.dequantize(copy.deepcopy(model))(ids).logits
    torch.testing.assert_close(dequantized, quantized, rtol=1e-4, atol=1e-4)
    for train in ("grids", "weights"):
        trained = copy.deepcopy(model)
        swapped = fake_quantize(trained, options=QATOptions(train=train))
        assert swapped["model.layers.0.mlp.down_proj"].fake.input_rotation == 64
        with torch.no_grad():
            torch.testing.assert_close(trained(ids).logits, quantized, rtol=1e-4, atol=1e-4)
        write_back(trained, swapped)
        with torch.no_grad():
            torch.testing.assert_close(trained(ids).logits, quantized, rtol=1e-4, atol=1e-4)


def test_awq_searches_a_rotated_layer_on_the_grid_it_is_stored_on() -> None:
    """AWQ's scales multiply the columns of `W`; the rotated layer stores `(W s) R`: the search scores that."""
    from quantlab.calibration.sequential import _fake_quantizer

    torch.manual_seed(6)
    weight = torch.randn(16, 96)
    config = quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True, rotate_inputs=["fc"])
    layer_class = type(quantlab.quantize(nn.Linear(96, 8), config.config_for("other")))
    scored = _fake_quantizer(config.config_for, layer_class)(weight, "fc")
    linear = nn.Linear(96, 16, bias=False)
    linear.weight.data = weight.clone()
    torch.testing.assert_close(scored, quantlab.quantize(linear, config.config_for("fc")).dequantize_weight())
    plain = _fake_quantizer(config.config_for, layer_class)(weight, "other")
    assert not torch.allclose(plain, scored)


def test_a_config_without_rotation_saves_no_rotation_key() -> None:
    """Checkpoints that rotate nothing, or rotate power-of-two blocks, stay readable by releases before
    `rotate_inputs` or `rotation_blocks`; the others are refused there by name (an unknown option) instead of
    running rotated codes on unrotated inputs, or on other blocks."""
    assert "rotate_inputs" not in quantlab.CustomBitsConfig(bits=4).to_dict()
    saved = quantlab.CustomBitsConfig(bits=4, rotate_inputs=DOWN).to_dict()
    assert saved["rotate_inputs"] == DOWN and "rotation_blocks" not in saved
    assert quantlab.CustomBitsConfig.from_dict(saved).rotation_blocks == "power_of_two"
    whole = quantlab.CustomBitsConfig(bits=4, rotate_inputs=DOWN, rotation_blocks="largest").to_dict()
    assert whole["rotation_blocks"] == "largest"
    assert quantlab.CustomBitsConfig.from_dict(whole).rotation_blocks == "largest"


def test_a_checkpoint_of_each_block_rule_reloads_with_its_blocks(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(8))
    for rule, block in (("power_of_two", 64), ("largest", 192)):  # the MLP's 192 inputs: 3 x 64, or 12 x 16
        config = quantlab.CustomBitsConfig(bits=4, group_size=32, rotate_inputs=DOWN, rotation_blocks=rule)
        model = quantlab.quantize(tiny_llama(seed=7), config)
        model.save_pretrained(tmp_path / rule)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / rule)
        assert reloaded.model.layers[0].mlp.down_proj.input_rotation == block
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
