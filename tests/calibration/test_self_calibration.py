"""Self-calibration on tiny models: the float model samples its own calibration windows, reproducibly,
reading no text; GPTQ on them beats round-to-nearest on text it never saw; bad input is refused."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.assets import text as bundled_text_module
from quantlab.calibration import data as calibration_data
from quantlab.calibration.data import CalibrationDataError
from quantlab.calibration.self_generated import self_generated_windows
from quantlab.errors import ConfigError, QuantizationError
from quantlab.testing.models import tiny_bert, tiny_llama, tiny_model_dir

UNSEEN = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))


def _self_calibrated(**options) -> quantlab.NF4Config:
    return quantlab.NF4Config(
        blocksize=32, solver="gptq", self_calibration=True, calibration_samples=16, calibration_seq_len=48, **options
    )


def test_windows_are_whole_start_at_bos_and_repeat_without_touching_the_callers_random_state():
    model = tiny_llama()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = self_generated_windows(model, samples=5, seq_len=20, progress=False)
    assert torch.equal(torch.rand(3), expected_next)  # the draw had its own seed
    assert first.shape == (5, 20) and first.dtype == torch.long
    assert (first[:, 0] == model.config.bos_token_id).all()
    assert torch.equal(first, self_generated_windows(model, samples=5, seq_len=20, progress=False))
    assert len(first[:, 1:].unique()) > 20  # sampled text, not one token repeated


def test_self_calibration_reads_no_text(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("self-calibration read text")

    for module in (calibration_data, bundled_text_module):
        monkeypatch.setattr(module, "bundled_text", refuse)
        monkeypatch.setattr(module, "read_text", refuse)
    model = tiny_llama()
    quantlab.quantize(model, _self_calibrated(), progress=False)  # no tokenizer, no calibration argument
    assert len(quantlab.replacement.quantized_layers(model)) == 2 * 7


def test_gptq_on_self_generated_text_beats_round_to_nearest_on_unseen_tokens():
    reference = tiny_llama()

    def logit_error(config: quantlab.QuantlabConfig) -> float:
        model = tiny_llama()
        quantlab.quantize(model, config, progress=False)
        with torch.no_grad():
            return (model(UNSEEN).logits - reference(UNSEEN).logits).square().mean().item()

    assert logit_error(_self_calibrated()) < 0.9 * logit_error(quantlab.NF4Config(blocksize=32))


def test_from_pretrained_self_calibrates_without_a_tokenizer_and_reloads_bit_identically(tmp_path):
    source = tiny_model_dir(tiny_llama(), tmp_path / "float")  # no tokenizer saved beside it
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=_self_calibrated())
    model.save_pretrained(tmp_path / "quantized")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized")
    with torch.no_grad():
        assert torch.equal(model(UNSEEN).logits, reloaded(UNSEEN).logits)


def test_a_model_that_does_not_generate_is_refused_with_the_fix():
    with pytest.raises(CalibrationDataError, match="does not generate text; pass calibration_text"):
        quantlab.quantize(tiny_bert(), _self_calibrated(), progress=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"solver": "rtn"}, "uses none; add solver='gptq'"),
        ({"calibration_text": "notes.txt"}, "drop calibration_text or self_calibration"),
        ({"self_calibration": "yes"}, "use true or false"),
    ],
)
def test_contradictory_configs_are_refused(options, message):
    settings = {"solver": "gptq", "self_calibration": True, **options}
    with pytest.raises(ConfigError, match=message):
        quantlab.NF4Config(**settings)


def test_explicit_calibration_beside_self_calibration_is_refused():
    with pytest.raises(QuantizationError, match="self_calibration samples its own text"):
        quantlab.quantize(tiny_llama(), _self_calibrated(), calibration=UNSEEN, progress=False)


def test_mixed_precision_with_a_data_free_solver_self_calibrates_its_allocation():
    config = quantlab.CustomBitsConfig(
        bits=3, group_size=32, target_bits=3.5, self_calibration=True, calibration_samples=8, calibration_seq_len=32
    )
    model = tiny_llama()
    quantlab.quantize(model, config, progress=False)
    widths = {layer.layout.bits for layer in quantlab.replacement.quantized_layers(model).values()}
    assert len(widths) > 1  # the allocation measured the layers on the sampled windows and mixed widths
