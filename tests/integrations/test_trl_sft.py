"""TRL's `SFTTrainer` on a quantlab NF4 model, as its documentation's QLoRA example runs on bitsandbytes.

A saved NF4 checkpoint, `SFTTrainer(model, peft_config=LoraConfig(target_modules="all-linear"))`
for a few steps on a text dataset, the adapter saved, then reloaded in a fresh process that
imports only transformers and peft: its logits must equal the trained model's bit for bit.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from peft import LoraConfig, PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import quantlab  # noqa: E402
from quantlab.testing import byte_tokenizer, tiny_llama  # noqa: E402

PROBE = "torch.arange(48).reshape(2, 24) * 5 % 256"

_RELOAD = textwrap.dedent(
    f"""
    import sys
    import torch
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    quantized_dir, adapter_dir, logits_file = sys.argv[1:4]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(quantized_dir), adapter_dir)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids={PROBE}).logits
    sys.exit(0 if torch.equal(logits, torch.load(logits_file)) else 3)
    """
)


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("nf4")
    float_dir = tmp_path_factory.mktemp("float")
    tiny_llama(0).save_pretrained(float_dir)
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=quantlab.NF4Config()).save_pretrained(directory)
    return directory


def _dataset():
    lines = ["the quick brown fox jumps over the lazy dog " * 3, "pack my box with five dozen liquor jugs " * 3]
    return datasets.Dataset.from_dict({"text": [lines[i % 2] for i in range(32)]})


@pytest.mark.subprocess
def test_sft_trainer_trains_lora_on_an_nf4_model_and_the_adapter_reloads_bit_identically(nf4_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(nf4_dir)
    codes_before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    config = SFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=8,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        max_length=64,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast, which accelerate leaves wrapped around forward
        seed=0,
        disable_tqdm=True,
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=_dataset(), processing_class=byte_tokenizer(), peft_config=lora
    )
    trainer.train()

    peft_model = trainer.model
    assert isinstance(peft_model, PeftModel)
    adapted = [m for m in peft_model.modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 14  # 7 projections x 2 layers; lm_head left out, as for a float model
    assert all(isinstance(m.get_base_layer(), quantlab.QuantizedLinear) for m in adapted)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 8 and losses[-1] < 0.95 * losses[0], losses  # 5.52 -> 5.13 after 6 steps
    base = peft_model.get_base_model()
    for name, buffer in base.named_buffers():  # the quantized base is frozen: its codes never move
        original = name.replace(".base_layer", "")
        if original in codes_before:
            assert torch.equal(buffer, codes_before[original]), name

    peft_model.save_pretrained(tmp_path / "adapter")
    peft_model.eval()
    with torch.no_grad():
        torch.save(peft_model(input_ids=eval(PROBE)).logits, tmp_path / "logits.pt")
    reloaded = subprocess.run(
        [sys.executable, "-c", _RELOAD, str(nf4_dir), str(tmp_path / "adapter"), str(tmp_path / "logits.pt")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert reloaded.returncode == 0, reloaded.stderr[-3000:]
