"""On the real SmolLM2-135M, the streamed checkpoint is the in-memory one byte for byte (slow: minutes per case).

The in-memory path is `from_pretrained(smollm2, quantization_config=...)` then `save_quantized`;
the streamed one (`quantlab quantize`'s) reads one block at a time. Calibration uses 16 windows of
128 tokens to keep each case to a few minutes; the schedule is the same at any size.
"""

from pathlib import Path

import pytest

import quantlab
from quantlab.assets.models import smollm2_dir
from quantlab.loading import load_tokenizer, model_class, read_config
from quantlab.saving import save_quantized
from quantlab.streaming.quantize import quantize_checkpoint

pytestmark = pytest.mark.slow

CALIBRATION = {"calibration_samples": 16, "calibration_seq_len": 128}
# One real-model case keeps the suite short: GPTQ's calibrated schedule (half the minutes of a mixed-precision
# case, whose measuring pass and per-layer widths are compared byte for byte on tiny dense models and mixtures:
# test_streamed_quantize.py, tests/calibration/test_allocation_experts.py), as is every other method and solver.
CASES = {
    "gptq": {"bits": 4, "group_size": 64, "symmetric": True, "solver": "gptq", **CALIBRATION},
}


@pytest.mark.parametrize("case", list(CASES))
def test_smollm2_streamed_equals_in_memory_byte_for_byte(case: str, tmp_path: Path) -> None:
    source = smollm2_dir()
    tokenizer = load_tokenizer(source)
    model = quantlab.load(source, quantlab.CustomBitsConfig(**CASES[case]))
    save_quantized(model, tmp_path / "in-memory", tokenizer)
    del model
    hf_config = read_config(source)
    config = quantlab.CustomBitsConfig(**CASES[case])
    quantize_checkpoint(source, hf_config, model_class(hf_config), config, tmp_path / "streamed", tokenizer=tokenizer)
    names = sorted(p.name for p in (tmp_path / "in-memory").iterdir())
    assert sorted(p.name for p in (tmp_path / "streamed").iterdir()) == names
    for name in names:
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "in-memory" / name).read_bytes(), name
