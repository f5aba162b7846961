"""A calibrated (GPTQ, mixed-precision) checkpoint is an ordinary checkpoint downstream: it exports
to ONNX with its own codes and takes LoRA training."""

import torch

import quantlab
from quantlab.export import OnnxCausalLM, to_onnx
from quantlab.replacement import quantized_layers
from quantlab.testing import tiny_llama
from quantlab.training import add_lora

CALIBRATION = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(0))


def _calibrated(config: quantlab.QuantlabConfig):
    model = tiny_llama()
    quantlab.quantize(model, config, calibration=CALIBRATION, progress=False)
    return model


def test_gptq_and_mixed_checkpoints_export_to_onnx_with_their_codes(tmp_path):
    for name, config in {
        "gptq": quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, solver="gptq"),
        "mixed": quantlab.CustomBitsConfig(bits=4, group_size=32, solver="gptq", target_bits=3.5),
    }.items():
        model = _calibrated(config)
        if name == "gptq":  # symmetric grids: some groups take a negative scale (all 16 levels)
            scales = torch.cat([layer.weight_scale.flatten() for layer in quantized_layers(model).values()])
            assert (scales < 0).any() and (scales > 0).any()
        path = tmp_path / f"{name}.onnx"
        result = to_onnx(model, path)
        assert set(result.layer_operators) == set(quantized_layers(model))
        ids = torch.randint(0, 256, (2, 12))
        mask = torch.ones_like(ids)
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
        assert (OnnxCausalLM(path)(ids, mask) - expected).abs().max() <= 1e-3, name


def test_a_gptq_model_takes_a_lora_step_that_lowers_the_loss():
    model = _calibrated(quantlab.NF4Config(blocksize=32, solver="gptq"))
    model = add_lora(model, r=4, alpha=8)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    batch = CALIBRATION[:4]
    losses = []
    for _ in range(5):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(layer.weight.grad is None for layer in quantized_layers(model).values())
