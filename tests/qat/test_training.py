"""The QAT loop on tiny Llamas, in process: codes written back bit for bit, the distillation loss falls."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.distill import DistillationConfig, token_kl
from quantlab.nn import QuantizedLinear
from quantlab.qat import QATOptions, QATTrainer, fake_quantize, float_linear_weights, train_quantized, write_back
from quantlab.testing import byte_tokenizer, tiny_llama
from quantlab.training import CausalLMCollator, TokenSequences, training_arguments

CONFIGS = {
    "3-bit g32 symmetric": lambda: quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True),
    "2-bit g32 with zero points": lambda: quantlab.CustomBitsConfig(bits=2, group_size=32),
    "nf4 b32": lambda: quantlab.NF4Config(blocksize=32),
    "lut 3-bit g32 (learned table)": lambda: quantlab.LutConfig(bits=3, group_size=32),
}


def _data(count: int = 16, length: int = 24, seed: int = 0) -> TokenSequences:
    generator = torch.Generator().manual_seed(seed)
    return TokenSequences(list(torch.randint(0, 256, (count, length), generator=generator)))


def _args(tmp_path, steps: int, lr: float = 0.05, **extra):
    values = {
        "output_dir": str(tmp_path / "run"),
        "max_steps": steps,
        "learning_rate": lr,
        "per_device_train_batch_size": 4,
        "lr_scheduler_type": "constant",
        "save_strategy": "no",
        **extra,
    }
    return training_arguments(values)  # fmt: skip


def _stored(model) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {k: v.clone() for k, v in m.stored_tensors().items()} for n, m in model.named_modules()
            if isinstance(m, QuantizedLinear)}  # fmt: skip


@pytest.mark.parametrize("name", CONFIGS)
def test_written_codes_equal_the_fake_quantizers_output_bit_for_bit(tmp_path, name):
    teacher = tiny_llama(0)
    student = quantlab.quantize(tiny_llama(0), CONFIGS[name]())
    before = _stored(student)
    swapped = fake_quantize(student, float_linear_weights(teacher), QATOptions())
    assert len(swapped) == 14 and all(layer.float_start for layer in swapped.values())
    with torch.no_grad():  # the first forward pass computes the checkpoint's weights
        for layer in swapped.values():
            assert torch.equal(layer.quantizer(), layer.quantized.dequantize_weight())
    trainer = QATTrainer(student, teacher, _args(tmp_path, 6), _data(), swapped=swapped, save_final=False,
                         data_collator=CausalLMCollator(0))  # fmt: skip
    trainer.train()
    with torch.no_grad():
        computed = {layer_name: layer.quantizer() for layer_name, layer in swapped.items()}
    write_back(student, swapped)
    assert all(isinstance(student.get_submodule(n), QuantizedLinear) for n in swapped)
    after = _stored(student)
    assert any(not torch.equal(after[n]["weight"], before[n]["weight"]) for n in after), "no code moved"
    student.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for layer_name, weight in computed.items():
        layer = reloaded.get_submodule(layer_name)
        assert type(layer) is type(swapped[layer_name].quantized)
        assert torch.equal(layer.dequantize_weight(), weight), layer_name
        for key, tensor in after[layer_name].items():
            assert torch.equal(layer.stored_tensors()[key], tensor)


def _mean_kl(student, teacher, batch: torch.Tensor) -> float:
    with torch.no_grad():
        return float(token_kl(teacher(batch).logits.flatten(0, 1), student(batch).logits.flatten(0, 1)).mean())


def test_a_short_run_lowers_the_distillation_loss(tmp_path):
    teacher = tiny_llama(0)
    student = quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=2, group_size=32, symmetric=True))
    tokenizer = byte_tokenizer()
    batch = torch.stack(list(_data(8, 24, seed=1).sequences))  # not trained on
    start = _mean_kl(student, teacher, batch)
    result = train_quantized(student, teacher, _args(tmp_path, 30, lr=0.02), _data(64, 24), tokenizer,
                             distillation=DistillationConfig(alpha=1.0, temperature=1.0))  # fmt: skip
    assert result.layers == 14 and result.float_started == 14
    assert len(result.losses) == 30 and result.losses[-1] < result.losses[0]
    assert isinstance(student.model.layers[0].mlp.up_proj, QuantizedLinear)
    assert _mean_kl(student, teacher, batch) < 0.8 * start


def test_options_are_checked_and_bound_the_offsets(tmp_path):
    from quantlab.errors import ConfigError

    with pytest.raises(ConfigError, match="max_offset"):
        QATOptions(max_offset=0)
    with pytest.raises(ConfigError, match="scale_lr_ratio"):
        QATOptions(scale_lr_ratio=0)
    teacher = tiny_llama(0)
    student = quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True))
    options = QATOptions(max_offset=0.25, learn_scales=False)
    swapped = fake_quantize(student, float_linear_weights(teacher), options)
    trainer = QATTrainer(student, teacher, _args(tmp_path, 5, lr=0.2), _data(), swapped=swapped, options=options,
                         save_final=False, data_collator=CausalLMCollator(0))  # fmt: skip
    trainer.train()
    offsets = torch.cat([layer.quantizer.offset.detach().flatten() for layer in swapped.values()])
    assert float(offsets.abs().max()) == pytest.approx(0.25)
    assert all(bool((layer.quantizer.scale_ratio == 1).all()) for layer in swapped.values())
    lrs = sorted(group["lr"] for group in trainer.optimizer.param_groups)
    assert lrs == [pytest.approx(0.2)]  # offsets only: no scale trains, symmetric grids have no zero point


def test_scales_train_at_their_own_rate(tmp_path):
    teacher = tiny_llama(0)
    student = quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=2, group_size=32))
    options = QATOptions(scale_lr_ratio=0.1)
    swapped = fake_quantize(student, float_linear_weights(teacher), options)
    trainer = QATTrainer(student, teacher, _args(tmp_path, 1, lr=0.01, weight_decay=0.1), _data(), swapped=swapped,
                         options=options, save_final=False, data_collator=CausalLMCollator(0))  # fmt: skip
    trainer.create_optimizer()
    groups = [(group["lr"], group["weight_decay"], len(group["params"])) for group in trainer.optimizer.param_groups]
    assert groups == [(0.01, 0.1, 14), (0.01, 0.0, 14), (pytest.approx(0.001), 0.0, 14)]


def test_normalization_weights_train_only_when_asked_at_their_own_rate(tmp_path):
    from quantlab.errors import ConfigError
    from quantlab.qat.swap import normalization_parameters

    with pytest.raises(ConfigError, match="norm_lr_ratio"):
        QATOptions(norm_lr_ratio=0)
    teacher = tiny_llama(0)
    frozen = quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True))
    fake_quantize(frozen, float_linear_weights(teacher), QATOptions())
    assert not any(p.requires_grad for p in normalization_parameters(frozen).values())

    student = quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True))
    norms = normalization_parameters(student)
    assert len(norms) == 2 * 2 + 1  # two per block (attention and MLP inputs) and the final one
    before = {name: p.detach().clone() for name, p in norms.items()}
    options = QATOptions(norm_lr_ratio=0.5)
    swapped = fake_quantize(student, float_linear_weights(teacher), options)
    trainer = QATTrainer(student, teacher, _args(tmp_path, 4, lr=0.02), _data(), swapped=swapped, options=options,
                         save_final=False, data_collator=CausalLMCollator(0))  # fmt: skip
    trainer.train()
    final_norm = norms["model.norm.weight"]
    norm_group = [g for g in trainer.optimizer.param_groups if any(p is final_norm for p in g["params"])]
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in norm_group] == [(pytest.approx(0.01), 0.0, 5)]
    moved = [name for name, p in norms.items() if not torch.equal(p.detach(), before[name])]
    assert sorted(moved) == sorted(norms)
    write_back(student, swapped)
    student.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for name, parameter in norms.items():
        assert torch.equal(reloaded.get_parameter(name), parameter.detach()), name


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_tables_train_only_when_asked_at_their_own_rate(tmp_path, tied):
    from quantlab.errors import ConfigError
    from quantlab.qat.swap import embedding_parameters

    with pytest.raises(ConfigError, match="embedding_lr_ratio"):
        QATOptions(embedding_lr_ratio=-1.0)
    config = quantlab.CustomBitsConfig(bits=3, group_size=32, symmetric=True)
    teacher = tiny_llama(0, tied)
    frozen = quantlab.quantize(tiny_llama(0, tied), config)
    fake_quantize(frozen, float_linear_weights(teacher), QATOptions(norm_lr_ratio=0.5))
    assert not any(p.requires_grad for p in embedding_parameters(frozen).values())

    student = quantlab.quantize(tiny_llama(0, tied), config)
    tables = embedding_parameters(student)
    assert sorted(tables) == ["lm_head.weight", "model.embed_tokens.weight"]  # the head stays float
    assert (tables["lm_head.weight"] is tables["model.embed_tokens.weight"]) == tied
    before = {name: p.detach().clone() for name, p in tables.items()}
    options = QATOptions(embedding_lr_ratio=0.5)
    swapped = fake_quantize(student, float_linear_weights(teacher), options)
    trainer = QATTrainer(student, teacher, _args(tmp_path, 4, lr=0.02, weight_decay=0.1), _data(), swapped=swapped,
                         options=options, save_final=False, data_collator=CausalLMCollator(0))  # fmt: skip
    trainer.train()
    table = tables["model.embed_tokens.weight"]
    table_group = [g for g in trainer.optimizer.param_groups if any(p is table for p in g["params"])]
    entries = 1 if tied else 2
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in table_group] == [
        (pytest.approx(0.01), 0.0, entries)
    ]
    assert all(not torch.equal(p.detach(), before[name]) for name, p in tables.items())
    write_back(student, swapped)
    student.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for name, parameter in tables.items():
        assert torch.equal(reloaded.get_parameter(name), parameter.detach()), name
    tokens = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, student(tokens).logits)
