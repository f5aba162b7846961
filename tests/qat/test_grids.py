"""Training only the grids (E2E-QP): codes kept, the loss falls, the result reloads; `auto` picks by memory."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantlab
from quantlab.cli.main import main
from quantlab.distill import DistillationConfig, token_kl
from quantlab.distill.teacher import CompactLinear, hold_linear_weights_in
from quantlab.errors import ConfigError
from quantlab.nn import QuantizedLinear
from quantlab.qat import QATOptions, train_quantized
from quantlab.qat.memory import predict_peak, resolve_training
from quantlab.testing import byte_tokenizer, tiny_llama
from quantlab.training import TokenSequences, training_arguments


def _data(count: int, length: int = 24, seed: int = 0) -> TokenSequences:
    generator = torch.Generator().manual_seed(seed)
    return TokenSequences(list(torch.randint(0, 256, (count, length), generator=generator)))


def _codes(model) -> dict[str, torch.Tensor]:
    return {name: module.layout.bind(module.stored_tensors()).load(module.stored_tensors())[0]
            for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}  # fmt: skip


def _mean_kl(student, teacher, batch: torch.Tensor) -> float:
    with torch.no_grad():
        return float(token_kl(teacher(batch).logits.flatten(0, 1), student(batch).logits.flatten(0, 1)).mean())


@pytest.mark.parametrize("config", [quantlab.CustomBitsConfig(bits=2, group_size=32), quantlab.NF4Config(blocksize=32),
                                    quantlab.LutConfig(bits=3, group_size=32)],
                         ids=["2-bit g32 with zero points", "nf4", "lut 3-bit g32 (its tables train)"])  # fmt: skip
def test_training_grids_keeps_the_codes_lowers_the_loss_and_reloads(tmp_path, config):
    teacher = tiny_llama(0)
    student = quantlab.quantize(tiny_llama(0), config)
    codes = _codes(student)
    tables = {name: tensor.clone() for name, tensor in student.state_dict().items() if name.endswith("weight_table")}
    batch = torch.stack(list(_data(8, seed=1).sequences))  # not trained on
    start = _mean_kl(student, teacher, batch)
    args = training_arguments({"output_dir": str(tmp_path / "run"), "max_steps": 30, "learning_rate": 0.05,
                               "per_device_train_batch_size": 4, "lr_scheduler_type": "constant",
                               "save_strategy": "no"})  # fmt: skip
    result = train_quantized(student, teacher, args, _data(64), byte_tokenizer(), options=QATOptions(train="grids"),
                             distillation=DistillationConfig(alpha=1.0, temperature=1.0))  # fmt: skip
    assert result.options.train == "grids" and result.layers == 14 and result.float_started == 0
    assert result.losses[-1] < result.losses[0]
    assert _mean_kl(student, teacher, batch) < 0.9 * start
    after = _codes(student)
    assert all(torch.equal(after[name], codes[name]) for name in codes)
    trained_tables = {name: student.state_dict()[name] for name in tables}
    assert all(not torch.equal(trained_tables[name], tables[name]) for name in tables)
    student.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(reloaded(batch).logits, student(batch).logits)


def test_auto_takes_weights_where_they_fit_and_grids_where_they_do_not():
    teacher, student = tiny_llama(0), quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=3))
    weights = predict_peak(student, teacher, "weights", 4, 256)
    grids = predict_peak(student, teacher, "grids", 4, 256)
    assert grids.trained_state < weights.trained_state and grids.total < weights.total
    checkpointed = predict_peak(student, teacher, "grids", 4, 256, activation_checkpointing=True)
    assert checkpointed.activations < grids.activations
    tables = predict_peak(student, teacher, "grids", 4, 256, tables_train=True)
    entries = student.get_input_embeddings().weight.numel()  # untied: the head has as many again
    assert tables.trained_state - grids.trained_state == 12 * 2 * entries + 4 * entries  # + the chunked head's sum
    roomy = resolve_training(QATOptions(), student, teacher, 4, 256, available=10 * weights.total)
    tight = resolve_training(QATOptions(), student, teacher, 4, 256, available=weights.total)
    assert (roomy.train, tight.train) == ("weights", "grids")
    bounded = resolve_training(QATOptions(max_offset=0.5), student, teacher, 4, 256, available=1)
    assert bounded.train == "weights"
    with pytest.raises(ConfigError, match="keeps the codes"):
        QATOptions(train="grids", max_offset=0.5)
    with pytest.raises(ConfigError, match="train="):
        QATOptions(train="codes")


def test_a_teacher_held_in_bfloat16_computes_in_float32_and_keeps_a_tied_head():
    model = tiny_llama(0)
    batch = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        before = model(batch).logits
    assert hold_linear_weights_in(model, torch.bfloat16) == 15
    layer = model.model.layers[0].mlp.up_proj
    assert isinstance(layer, CompactLinear) and layer.weight.dtype == torch.bfloat16
    with torch.no_grad():
        after = model(batch).logits
    assert after.dtype == torch.float32 and 0 < float((after - before).abs().max()) < 1e-2
    config = tiny_llama(0).config
    tied = AutoModelForCausalLM.from_config(config.__class__(**{**config.to_dict(), "tie_word_embeddings": True}))
    tied.tie_weights()
    assert hold_linear_weights_in(tied, torch.bfloat16) == 14
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_the_cli_trains_grids_with_a_compact_teacher(tmp_path, capsys, make_checkpoint):
    teacher = make_checkpoint(tmp_path / "float", 0)
    argv = ["qat", str(teacher), "--method", "custom_bits", "--bits", "3", "--group-size", "32", "--train", "grids",
            "--teacher-weights", "bfloat16", "--max-steps", "3", "--max-seq-length", "32", "--batch-size", "2",
            "--learning-rate", "0.05", "-o", str(tmp_path / "run"), "--json"]  # fmt: skip
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["trained"] == "grids" and report["teacher_weights"] == "bfloat16"
    assert report["layers_from_float_weights"] == 0 and report["predicted_peak_memory_bytes"] > 0
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "start")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert all(torch.equal(a, b) for a, b in zip(_codes(start).values(), _codes(final).values(), strict=True))
    code = main([*argv[:8], "--train", "grids", "--max-offset", "0.5", "--max-steps", "1", "-o", str(tmp_path / "x")])
    assert code == 2 and "keeps the codes" in capsys.readouterr().err


def test_activation_checkpointing_recomputes_the_student_and_gives_the_same_steps(tmp_path):
    from quantlab.nn import grid_trained

    calls = []
    forward = grid_trained._GridLinear.forward
    counting = staticmethod(lambda *args: calls.append(1) or forward(*args))
    losses = {}
    for checkpointing in (False, True):
        calls.clear()
        teacher, student = tiny_llama(0), quantlab.quantize(tiny_llama(0), quantlab.CustomBitsConfig(bits=2))
        args = training_arguments({"output_dir": str(tmp_path / "run"), "max_steps": 2, "learning_rate": 0.05,
                                   "per_device_train_batch_size": 4, "save_strategy": "no",
                                   "activation_checkpointing": checkpointing})  # fmt: skip
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(grid_trained._GridLinear, "forward", counting)
            result = train_quantized(student, teacher, args, _data(16), byte_tokenizer(),
                                     options=QATOptions(train="grids"))  # fmt: skip
        losses[checkpointing] = (result.losses, len(calls))
    assert losses[True][0] == losses[False][0]
    assert losses[True][1] == 2 * losses[False][1]


def test_a_teacher_read_from_its_files_holds_the_same_weights(tmp_path, make_checkpoint):
    from quantlab.loading import load_checkpoint
    from quantlab.streaming.reader import CheckpointReader

    folder = make_checkpoint(tmp_path / "float", 0)
    mapped, read = load_checkpoint(folder), load_checkpoint(folder)
    hold_linear_weights_in(mapped, torch.bfloat16)
    with CheckpointReader(folder) as reader:
        assert hold_linear_weights_in(read, torch.bfloat16, reader) == 15
    assert all(torch.equal(a, b) for a, b in zip(mapped.state_dict().values(), read.state_dict().values(), strict=True))
