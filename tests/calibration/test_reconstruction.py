"""Block-wise reconstruction on tiny Llamas: it lowers the block output error GPTQ leaves, stores exactly
what its fake quantizer computed, works for every codec and width and mixed precision, and holds one
block's trainable numbers at a time."""

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import quantlab
from quantlab.calibration.block_training import BlockReconstruction
from quantlab.calibration.blocks import BlockInputs, find_blocks, first_block_inputs, run_block
from quantlab.errors import ConfigError
from quantlab.methods.custom_bits import CustomBitsLinear
from quantlab.nn import fake_quant
from quantlab.replacement import quantized_layers
from quantlab.solvers.reconstruct import ReconstructOptions
from quantlab.testing.models import tiny_llama

CALIBRATION = torch.randint(0, 256, (16, 48), generator=torch.Generator().manual_seed(0))
UNSEEN = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(1))
MORE_CALIBRATION = torch.randint(0, 256, (32, 64), generator=torch.Generator().manual_seed(2))  # enough not to overfit
STEPS = {"steps": 30, "batch_size": 4}


@pytest.fixture(autouse=True)
def one_thread():
    """Many small steps: one thread is faster than two on a shared machine (and the figures are the same)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _quantized(config: quantlab.QuantlabConfig, calibration: torch.Tensor = CALIBRATION) -> torch.nn.Module:
    return quantlab.quantize(tiny_llama(), config, calibration=calibration, progress=False)


def _hidden_error(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """Squared error of the last hidden states against the float model's."""
    reference = tiny_llama()
    with torch.no_grad():
        return (
            (model.model(tokens).last_hidden_state - reference.model(tokens).last_hidden_state).square().mean().item()
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda solver, **o: quantlab.CustomBitsConfig(bits=2, group_size=32, symmetric=True, solver=solver, **o),
        lambda solver, **o: quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=False, solver=solver, **o),
        lambda solver, **o: quantlab.NF4Config(blocksize=32, solver=solver, **o),
    ],
    ids=["2-bit-sym", "3-bit-asym", "nf4"],
)
def test_reconstruction_lowers_the_error_gptq_leaves(make):
    gptq = _quantized(make("gptq"), MORE_CALIBRATION)
    reconstructed = _quantized(make("reconstruct", solver_options=STEPS), MORE_CALIBRATION)
    assert _hidden_error(reconstructed, MORE_CALIBRATION) < 0.9 * _hidden_error(gptq, MORE_CALIBRATION)


def test_at_2_bits_the_gain_holds_on_unseen_tokens():
    """A random tiny model on random tokens: only the large 2-bit gain stands out of the noise on 8 windows."""
    storage = {"bits": 2, "group_size": 32, "symmetric": True}
    gptq = _quantized(quantlab.CustomBitsConfig(**storage, solver="gptq"), MORE_CALIBRATION)
    config = quantlab.CustomBitsConfig(**storage, solver="reconstruct", solver_options=STEPS)
    reconstructed = _quantized(config, MORE_CALIBRATION)
    assert _hidden_error(reconstructed, UNSEEN) < 0.9 * _hidden_error(gptq, UNSEEN)


def test_encoder_blocks_reconstruct():
    from quantlab.testing.models import tiny_bert

    config = quantlab.CustomBitsConfig(bits=3, group_size=32, solver="reconstruct", solver_options=STEPS)
    model = quantlab.quantize(tiny_bert(), config, calibration=CALIBRATION[:, :32], progress=False)
    assert "encoder.layer.1.output.dense" in quantized_layers(model)


def test_a_block_left_in_float_passes_the_float_hidden_states_on():
    first_block = tiny_llama().model.layers[0].named_modules()
    skip = ["lm_head"] + [f"model.layers.0.{name}" for name, _ in first_block if name.count(".") == 1]
    config = quantlab.CustomBitsConfig(bits=3, group_size=32, solver="reconstruct", solver_options=STEPS)
    model = _quantized(config.for_one_layer(modules_to_not_convert=skip))
    assert sorted({name.split(".")[2] for name in quantized_layers(model)}) == ["1"]
    gptq = _quantized(config.for_one_layer(modules_to_not_convert=skip, solver="gptq", solver_options=None))
    assert _hidden_error(model, CALIBRATION) < _hidden_error(gptq, CALIBRATION)


def test_no_steps_is_the_start_solver_bit_for_bit():
    gptq = _quantized(quantlab.CustomBitsConfig(bits=3, group_size=32, solver="gptq"))
    config = quantlab.CustomBitsConfig(bits=3, group_size=32, solver="reconstruct", solver_options={"steps": 0})
    start = _quantized(config)
    for name, tensor in gptq.state_dict().items():
        assert torch.equal(start.state_dict()[name], tensor), name


def _block_setup(config: quantlab.QuantlabConfig, **options):
    model = tiny_llama()
    _, blocks = find_blocks(model)
    batches = first_block_inputs(model, blocks[0], CALIBRATION, batch_size=8)
    block = blocks[0]
    names = {name: name for name, module in block.named_modules() if type(module) is torch.nn.Linear}
    reconstruction = BlockReconstruction(ReconstructOptions(**{**STEPS, **options}), batches)
    reconstruction.prepare(block, names, batches)
    layers = {name: CustomBitsLinear.from_linear(block.get_submodule(name), config) for name in names}
    return block, batches, layers, reconstruction


@pytest.mark.parametrize(
    "options",
    [{}, {"target": "float_block"}, {"optimizer": "signsgd", "lr": 0.005}, {"loss": "mse", "max_offset": None}],
    ids=["defaults", "float-block", "signsgd", "mse-unbounded"],
)
def test_the_block_outputs_are_those_of_the_stored_weights(options):
    """What refine returns (computed through the fake quantizers) is the block with the stored weights, exactly."""
    config = quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True)
    block, batches, layers, reconstruction = _block_setup(config, **options)
    outputs = reconstruction.refine(block, layers, batches, progress=False)
    result = reconstruction.results[-1]
    assert result.best_step is not None and result.final_error < result.start_error
    for name, layer in layers.items():
        assert torch.equal(block.get_submodule(name).weight, layer.dequantize_weight())
    with torch.no_grad():
        for output, batch in zip(outputs, batches, strict=True):
            assert torch.equal(output, run_block(block, batch))


def test_the_start_is_kept_when_training_does_not_help():
    """A step size so large that every step overshoots: the start (GPTQ's codes) is what is stored."""
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True)
    block, batches, layers, reconstruction = _block_setup(config, lr=50.0, steps=3, max_offset=None)
    before = {name: layer.dequantize_weight() for name, layer in layers.items()}
    reconstruction.refine(block, layers, batches, progress=False)
    if reconstruction.results[-1].best_step is None:
        for name, layer in layers.items():
            assert torch.equal(layer.dequantize_weight(), before[name])
    assert reconstruction.results[-1].final_error <= reconstruction.results[-1].start_error


def test_one_block_of_trainable_numbers_at_a_time(monkeypatch):
    """Memory stays bounded by one block: no fake quantizer outlives its block's training."""
    alive: weakref.WeakSet = weakref.WeakSet()
    most = 0
    original = fake_quant.FakeQuantizedWeight.__init__

    def counting(self, *args, **kwargs):
        nonlocal most
        original(self, *args, **kwargs)
        gc.collect()
        alive.add(self)
        most = max(most, len(alive))

    monkeypatch.setattr(fake_quant.FakeQuantizedWeight, "__init__", counting)
    _quantized(quantlab.CustomBitsConfig(bits=3, group_size=32, solver="reconstruct", solver_options={"steps": 2}))
    assert most == 7  # the seven Linear layers of one Llama block


CODEC_CASES = {
    "affine-2-sym": quantlab.CustomBitsConfig(bits=2, group_size=32, symmetric=True),
    "affine-3-asym": quantlab.CustomBitsConfig(bits=3, group_size=64, symmetric=False),
    "affine-4-sym": quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True),
    "int8": quantlab.Int8SymmetricConfig(),
    "nf4-dq": quantlab.NF4Config(blocksize=32),
    "mixed-3.5": quantlab.CustomBitsConfig(bits=3, group_size=32, target_bits=3.5),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each codec case reconstructed and saved, with its logits on unseen tokens."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("reconstructed")
    cases = {}
    for case, config in CODEC_CASES.items():
        config = type(config).from_options({**_options(config), "solver": "reconstruct", "solver_options": STEPS})
        model = _quantized(config)
        model.save_pretrained(root / case)
        with torch.no_grad():
            cases[case] = (model, model(UNSEEN).logits)
    torch.set_num_threads(previous)
    return root, cases


def _options(config: quantlab.QuantlabConfig) -> dict:
    return {name: getattr(config, name) for name in config.option_names()}


@pytest.mark.parametrize("case", list(CODEC_CASES))
def test_every_codec_is_stored_in_its_own_format(saved, case):
    model = saved[1][case][0]
    layers = quantized_layers(model)
    assert len(layers) == 14
    assert all(layer.config.solver == "reconstruct" for layer in layers.values())
    if case.startswith("mixed"):
        assert len({(layer.layout.bits, layer.layout.group_size) for layer in layers.values()}) > 1


def test_checkpoints_reload_in_a_fresh_process_with_the_same_logits(saved, tmp_path):
    root, cases = saved
    expected = tmp_path / "expected.pt"
    torch.save({case: logits for case, (_, logits) in cases.items()}, expected)
    child = textwrap.dedent(f"""
        import json, torch, quantlab
        expected = torch.load({str(expected)!r})
        tokens = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(1))
        same = {{}}
        for case, logits in expected.items():
            model = quantlab.load({str(root)!r} + "/" + case)
            with torch.no_grad():
                same[case] = torch.equal(model(tokens).logits, logits)
        print(json.dumps(same))
    """)
    result = subprocess.run([sys.executable, "-c", child], check=True, timeout=600, capture_output=True, text=True)
    assert result.stdout.strip().splitlines()[-1] == '{"' + '": true, "'.join(cases) + '": true}'


def test_gguf_export_keeps_the_reconstructed_codes(saved, tmp_path):
    pytest.importorskip("gguf", reason="needs the gguf package")
    from quantlab.export.gguf import to_gguf
    from quantlab.testing.tokenizer import byte_tokenizer

    result = to_gguf(saved[1]["affine-4-sym"][0], tmp_path / "tiny.gguf", tokenizer=byte_tokenizer())
    assert result.type_counts()["Q4_0"] == 14
    assert all(tensor.exact for tensor in result.tensors if tensor.type == "Q4_0")


def test_a_lora_step_trains_on_a_reconstructed_model():
    from peft import prepare_model_for_kbit_training

    from quantlab.training import add_lora

    model = _quantized(quantlab.CustomBitsConfig(bits=3, group_size=32, solver="reconstruct", solver_options=STEPS))
    prepare_model_for_kbit_training(model, False)
    model = add_lora(model, r=4, alpha=8, dropout=0.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    loss = model(CALIBRATION[:4], labels=CALIBRATION[:4]).loss
    loss.backward()
    assert trainable and all(p.grad is not None for p in trainable)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"step": 10}, r"unknown option\(s\) \['step'\]"),
        ({"steps": -1}, "steps=-1 must be a whole number >= 0"),
        ({"lr": 0}, "lr=0 must be a number > 0"),
        ({"start": "reconstruct"}, "must name another solver"),
        ({"start": "optq"}, "unknown solver 'optq'"),
        ({"target": "float"}, "target='float' must be one of"),
        ({"optimizer": "sgd"}, "optimizer='sgd' must be one of"),
        ({"loss": "l1"}, "loss='l1' must be one of"),
        ({"learn_scales": "yes"}, "learn_scales='yes' must be true or false"),
    ],
)
def test_bad_options_are_refused_when_the_config_is_built(options, message):
    with pytest.raises(ConfigError, match=message):
        quantlab.CustomBitsConfig(solver="reconstruct", solver_options=options)


def test_the_command_line_refuses_bad_options_in_one_line(tmp_path, capsys):
    from quantlab.cli.main import main
    from quantlab.testing.models import tiny_llama_checkpoint

    source = tiny_llama_checkpoint(tmp_path / "float")
    arguments = ["quantize", str(source), "--output", str(tmp_path / "out"), "--method", "custom_bits"]
    code = main([*arguments, "--solver", "reconstruct", "--solver-options", '{"steps": "many"}'])
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "steps='many'" in error
    assert not (tmp_path / "out").exists()


def test_windows_of_a_batch_keep_their_own_keyword_arguments():
    from quantlab.calibration.block_training import _select

    hidden = torch.arange(4 * 3 * 2.0).view(4, 3, 2)
    kwargs = {"mask": torch.arange(4.0).view(4, 1), "shared": (torch.ones(1, 3), None), "flag": True}
    chosen = _select(BlockInputs(hidden, kwargs), [3, 1])
    assert torch.equal(chosen.hidden, hidden[[3, 1]])
    assert torch.equal(chosen.kwargs["mask"], torch.tensor([[3.0], [1.0]]))
    assert chosen.kwargs["shared"][0].shape == (1, 3) and chosen.kwargs["flag"] is True


def test_windows_of_several_batches_are_merged_into_one():
    from quantlab.calibration.block_training import _merged

    first, second = torch.arange(24.0).view(4, 3, 2), 100 + torch.arange(12.0).view(2, 3, 2)
    targets = [-first, -second]
    shared = (torch.ones(1, 3), None)
    parts = [
        (
            BlockInputs(first, {"mask": torch.arange(4.0).view(4, 1), "shared": shared, "flag": True}),
            targets[0],
            [3, 1],
        ),
        (
            BlockInputs(second, {"mask": 10 + torch.arange(2.0).view(2, 1), "shared": shared, "flag": True}),
            targets[1],
            [1],
        ),
    ]
    inputs, target = _merged(parts)
    assert torch.equal(inputs.hidden, torch.cat([first[[3, 1]], second[[1]]]))
    assert torch.equal(target, -inputs.hidden)
    assert torch.equal(inputs.kwargs["mask"], torch.tensor([[3.0], [1.0], [11.0]]))
    assert inputs.kwargs["shared"][0] is shared[0] and inputs.kwargs["flag"] is True
    # A value that is neither per window nor the same in every batch: the batches cannot be merged.
    parts[1][0].kwargs["shared"] = (torch.zeros(1, 3), None)
    assert _merged(parts) is None


def test_a_merged_step_has_the_gradients_of_the_batch_by_batch_step(monkeypatch):
    """Windows from several batches through the block at once: the same loss and gradients as one batch at a time."""
    from quantlab.calibration import block_training

    config = quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True)
    block, batches, layers, state = _block_setup(config)
    quantizers = {
        name: fake_quant.FakeQuantizedWeight.from_solution(
            layer.layout, layer.stored_space(state._float_weights[name]), layer.stored_tensors()
        )
        for name, layer in layers.items()
    }
    windows = [(0, 5), (1, 2), (0, 1), (1, 7)]
    parts = [(batches[b], state._targets[b], [w for c, w in windows if c == b]) for b in (0, 1)]
    assert block_training._merged(parts) is not None  # the calibration batches' keyword arguments merge
    results = []
    for merge in (True, False):
        if not merge:
            monkeypatch.setattr(block_training, "_merged", lambda parts: None)
        rotations = {name: 0 for name in quantizers}
        with block_training._frozen(block), block_training._swapped(block, quantizers, rotations):
            training = block_training._Training(block, quantizers, batches, state._targets, state.options)
            for q in quantizers.values():
                q.zero_grad(set_to_none=True)
            total = training._step_error(windows)
        grads = {name: q.offset.grad.clone() for name, q in quantizers.items()}
        results.append((total, grads))
    (merged_total, merged_grads), (split_total, split_grads) = results
    assert merged_total == pytest.approx(split_total, rel=1e-5)
    for name in merged_grads:
        torch.testing.assert_close(merged_grads[name], split_grads[name], rtol=1e-4, atol=1e-7)
