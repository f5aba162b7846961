"""Distillation on Trainer with tiny Llamas: the KL falls, pruned students stay pruned, runs resume."""

import copy

import pytest
import torch
from peft import prepare_model_for_kbit_training
from transformers import TrainerCallback

import quantlab
from quantlab.distill import DistillationConfig, distillation_trainer, token_kl
from quantlab.prune import mask_of, masked_layers, prune
from quantlab.testing import tiny_llama
from quantlab.training import TokenSequences, add_lora, read_log, training_arguments


def _sequences(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (16,), generator=generator) for _ in range(count)]


def _teacher() -> torch.nn.Module:
    """A tiny Llama with confident predictions (its output head scaled up), so there is something to learn."""
    teacher = tiny_llama(0)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30)
    return teacher


def _config(output_dir, **overrides):
    options = {
        "output_dir": str(output_dir),
        "max_steps": 12,
        "per_device_train_batch_size": 8,
        "learning_rate": 3e-4,
        "lr_scheduler_type": "constant",
        "disable_tqdm": True,
    }
    return training_arguments({**options, **overrides})


def _heldout_kl(teacher, student, seed: int = 99) -> float:
    x = torch.stack(_sequences(8, seed=seed))  # seed 99: never trained on
    with torch.no_grad():
        return float(token_kl(teacher(x).logits.flatten(0, 1), student(x).logits.flatten(0, 1)).mean())


def test_distillation_lowers_the_kl_to_the_teacher_on_held_out_text(tmp_path):
    teacher = _teacher()
    student = copy.deepcopy(teacher).train()
    prune(student, "unstructured", 0.6)
    before = _heldout_kl(teacher, student)
    trainer = distillation_trainer(
        student, teacher, _config(tmp_path), TokenSequences(_sequences(64, seed=0)),
        distillation=DistillationConfig(alpha=1.0, temperature=1.0),
    )  # fmt: skip
    trainer.train()
    after = _heldout_kl(teacher, student)
    assert after < 0.85 * before  # a clear drop, with room for run-to-run noise
    log = read_log(tmp_path)
    assert {"kl", "ce", "loss"} <= set(log[-2])  # the last step's record (the run's summary follows)
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())


def test_pruned_student_recovers_and_keeps_its_masks(tmp_path):
    teacher = _teacher()
    student = copy.deepcopy(teacher).train()
    prune(student, "2:4")
    masks = {name: mask_of(layer).clone() for name, layer in masked_layers(student).items()}
    before = _heldout_kl(teacher, student)
    trainer = distillation_trainer(student, teacher, _config(tmp_path), TokenSequences(_sequences(64, seed=0)))
    trainer.train()  # KeepMasks is added because the student carries masks
    assert _heldout_kl(teacher, student) < before
    for name, layer in masked_layers(student).items():
        assert not bool(layer.weight[~masks[name]].any()), name


def test_quantized_teacher_and_quantized_student_with_lora(tmp_path):
    float_teacher = _teacher()
    student = copy.deepcopy(float_teacher)
    prune(student, "unstructured", 0.6)
    student = quantlab.quantize(student, quantlab.Int8SymmetricConfig())
    student = add_lora(prepare_model_for_kbit_training(student, use_gradient_checkpointing=False), r=4, dropout=0.0)
    teacher = quantlab.quantize(float_teacher, quantlab.NF4Config(blocksize=32))
    before = _heldout_kl(teacher, student, seed=0)  # on training text: only the adapters move, slowly
    trainer = distillation_trainer(
        student, teacher, _config(tmp_path, learning_rate=1e-3), TokenSequences(_sequences(64, seed=0)),
        distillation=DistillationConfig(alpha=1.0, temperature=1.0),  # random tokens: CE would only add noise
    )  # fmt: skip
    trainer.train()
    assert _heldout_kl(teacher, student, seed=0) < before
    assert (tmp_path / "final" / "adapter_config.json").is_file()


class _Interrupt(Exception):
    pass


class _StopAt(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise _Interrupt


def test_resume_with_hidden_matching_continues_bit_identically(tmp_path):
    distillation = DistillationConfig(alpha=0.5, temperature=2.0, hidden_weight=0.1)
    data = TokenSequences(_sequences(32, seed=0))

    def run(output_dir, student, callbacks=(), resume=None):
        options = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "save_steps": 2}
        config = _config(output_dir, max_steps=5, **options)
        trainer = distillation_trainer(
            student, _teacher(), config, data, distillation=distillation, callbacks=list(callbacks)
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight", tiny_llama(1).train())
    with pytest.raises(_Interrupt):
        run(tmp_path / "resumed", tiny_llama(1).train(), callbacks=[_StopAt()])
    resumed = run(tmp_path / "resumed", tiny_llama(1).train(), resume="latest")
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    projection = [m.state_dict() for m in (straight.extra_modules["hidden_projection"],)]
    resumed_projection = resumed.extra_modules["hidden_projection"].state_dict()
    for name, tensor in projection[0].items():
        assert torch.equal(tensor, resumed_projection[name]), name


def _small_student() -> torch.nn.Module:
    """Half the width and depth of the tiny teacher, same vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(config).train()


def test_smaller_student_with_hidden_matching_under_bf16_autocast(tmp_path):
    distillation = DistillationConfig(alpha=0.5, temperature=2.0, hidden_weight=1.0, hidden_layers=[(1, 2)])
    trainer = distillation_trainer(
        _small_student(), _teacher(), _config(tmp_path, max_steps=2, bf16=True),
        TokenSequences(_sequences(16, seed=0)), distillation=distillation,
    )  # fmt: skip
    projection = trainer.extra_modules["hidden_projection"]
    assert projection.projections[0].weight.shape == (64, 32)  # student width -> teacher width
    before = projection.projections[0].weight.detach().clone()
    trainer.train()
    log = read_log(tmp_path)
    log = [record for record in log if "loss" in record]
    assert all(torch.isfinite(torch.tensor(record["loss"])) for record in log)
    assert log[-1]["hidden_mse"] > 0
    assert not torch.equal(projection.projections[0].weight.detach(), before)  # the projection trains


def test_distill_returns_the_finished_student_and_refuses_a_quantized_one_without_lora(tmp_path):
    from types import SimpleNamespace

    from quantlab.distill import distill
    from quantlab.errors import QuantlabError

    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    teacher, data = _teacher(), TokenSequences(_sequences(64, seed=0))
    quantized = quantlab.quantize(tiny_llama(1), quantlab.NF4Config(blocksize=32))
    with pytest.raises(QuantlabError, match="--lora-r"):
        distill(quantized, teacher, _config(tmp_path / "q"), data, tokenizer)
    student = tiny_llama(1)
    before = _heldout_kl(teacher, student)
    config = DistillationConfig(alpha=1.0, temperature=1.0)
    trained, losses = distill(student, teacher, _config(tmp_path / "f"), data, tokenizer, distillation=config)
    assert trained is student and not trained.training and len(losses) == 12
    assert _heldout_kl(teacher, trained) < before
