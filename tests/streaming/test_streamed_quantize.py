"""Streamed quantization writes the checkpoint the in-memory path writes, byte for byte, and resumes exactly.

The in-memory path is `from_pretrained(source, quantization_config=...)` then `save_quantized`;
the streamed one reads the source tensor by tensor and holds one block at a time. Both run on
tiny Llamas saved as safetensors, for every kind of config: round to nearest, GPTQ, AWQ + GPTQ,
mixed precision, self-calibration, quantized vocabulary tables, bf16 and tied-embedding sources.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quantlab
from quantlab.loading import load_tokenizer, model_class, read_config
from quantlab.saving import save_quantized
from quantlab.streaming.blocks import REST
from quantlab.streaming.partial import PartialOutput, ResumeError, interrupted_runs
from quantlab.streaming.quantize import quantize_checkpoint
from quantlab.testing import byte_tokenizer, tiny_llama, tiny_llama_checkpoint
from quantlab.testing.architectures import tiny_causal_lm

CALIBRATION = {"calibration_samples": 8, "calibration_seq_len": 32}
CASES = {
    "rtn": {"bits": 4, "group_size": 32},
    "gptq": {"bits": 4, "group_size": 32, "solver": "gptq", **CALIBRATION},
    "gptq symmetric": {"bits": 4, "group_size": 32, "symmetric": True, "solver": "gptq", **CALIBRATION},
    "awq+gptq": {"bits": 3, "group_size": 32, "solver": "gptq", "awq": True, **CALIBRATION},
    "mixed precision": {"bits": 4, "group_size": 32, "solver": "gptq", "target_bits": 4.5, **CALIBRATION},
    "self-calibration": {"bits": 4, "group_size": 32, "solver": "gptq", "self_calibration": True, **CALIBRATION},
    "embedding_bits": {"bits": 4, "group_size": 32, "embedding_bits": 8},
    "rotated rtn": {"bits": 3, "group_size": 32, "rotate_inputs": ["down_proj"]},
    "rotated mixed precision": {
        "bits": 3,
        "group_size": 32,
        "solver": "gptq",
        "target_bits": 3.5,
        "rotate_inputs": ["down_proj"],
        **CALIBRATION,
    },
}


def _source(directory: Path, tied: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    model = tiny_llama(0, tie_word_embeddings=tied).to(dtype)
    return tiny_llama_checkpoint(directory, model=model, tokenizer=byte_tokenizer())


def _in_memory(source: Path, options: dict, output: Path) -> Path:
    model = quantlab.load(source, quantlab.CustomBitsConfig(**options))
    return save_quantized(model, output, load_tokenizer(source))


def _streamed(source: Path, options: dict, output: Path, **kwargs) -> Path:
    hf_config = read_config(source)
    config = quantlab.CustomBitsConfig(**options)
    quantize_checkpoint(
        source, hf_config, model_class(hf_config), config, output, tokenizer=load_tokenizer(source), **kwargs
    )
    return output


def _same_checkpoint(expected: Path, got: Path) -> None:
    names = sorted(p.name for p in expected.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    for name in names:
        assert (got / name).read_bytes() == (expected / name).read_bytes(), name


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {
        "fp32": _source(root / "fp32"),
        "tied": _source(root / "tied", tied=True),
        "bf16 tied": _source(root / "bf16", tied=True, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_checkpoint_is_the_in_memory_one_byte_for_byte(case, sources, tmp_path):
    source = sources["tied"] if case in ("embedding_bits", "self-calibration") else sources["fp32"]
    expected = _in_memory(source, CASES[case], tmp_path / "in-memory")
    _same_checkpoint(expected, _streamed(source, CASES[case], tmp_path / "streamed"))


def test_a_bf16_source_streams_in_bf16_like_from_pretrained(sources, tmp_path):
    options = {**CASES["awq+gptq"], "target_bits": 3.5, "embedding_bits": 8}
    expected = _in_memory(sources["bf16 tied"], options, tmp_path / "in-memory")
    _same_checkpoint(expected, _streamed(sources["bf16 tied"], options, tmp_path / "streamed"))
    assert json.loads((tmp_path / "streamed" / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_output_reloads_with_the_same_tensors(sources, tmp_path):
    single = _streamed(sources["fp32"], CASES["gptq"], tmp_path / "single")
    sharded = _streamed(sources["fp32"], CASES["gptq"], tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged = {name: tensor for file in files for name, tensor in load_file(sharded / file).items()}
    expected = load_file(single / "model.safetensors")
    assert merged.keys() == expected.keys() and all(torch.equal(merged[k], expected[k]) for k in expected)
    reloaded, reference = quantlab.load(sharded), quantlab.load(single)
    ids = torch.arange(20).view(1, -1)
    assert torch.equal(reloaded(ids).logits, reference(ids).logits)


# -- interrupted, then resumed ----------------------------------------------------------------


class _Stop(KeyboardInterrupt):
    pass


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, part: str) -> None:
    """Ctrl-C right after `part` is recorded as finished."""
    complete = PartialOutput.complete

    def stopping(self, name, digest):
        complete(self, name, digest)
        if name == part:
            raise _Stop

    monkeypatch.setattr(PartialOutput, "complete", stopping)


@pytest.mark.parametrize(
    ("case", "stop_after"),
    [("rtn", "model.layers.0"), ("awq+gptq", "model.layers.0"), ("mixed precision", "model.layers.0"), ("gptq", REST)],
)
def test_an_interrupted_run_resumes_to_the_uninterrupted_result(case, stop_after, sources, tmp_path, monkeypatch):
    straight = _streamed(sources["fp32"], CASES[case], tmp_path / "straight")
    output = tmp_path / "out"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, stop_after)
        with pytest.raises(_Stop):
            _streamed(sources["fp32"], CASES[case], output)
    assert not output.exists()  # nothing that looks finished
    [left] = interrupted_runs(output)
    assert left.name.startswith(".out.partial-") and not (left / "config.json").exists()
    notes: list[str] = []
    _streamed(sources["fp32"], CASES[case], output, resume=True, note=notes.append)
    finished = 1 if stop_after != REST else 3  # two blocks and the rest
    assert any(f"{finished} part(s) finished" in note for note in notes), notes
    _same_checkpoint(straight, output)
    assert interrupted_runs(output) == []


@pytest.fixture(scope="module")
def gpt2_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 (its projections `Conv1D` layers, weights stored `[in, out]`) saved with a tokenizer."""
    folder = tmp_path_factory.mktemp("gpt2")
    tiny_causal_lm("gpt2").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", ["rtn", "gptq"])
def test_gpt2_streams_to_the_in_memory_checkpoint_and_resumes_exactly(case, gpt2_source, tmp_path, monkeypatch):
    expected = _in_memory(gpt2_source, CASES[case], tmp_path / "in-memory")
    _same_checkpoint(expected, _streamed(gpt2_source, CASES[case], tmp_path / "streamed"))
    output = tmp_path / "out"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "transformer.h.0")
        with pytest.raises(_Stop):
            _streamed(gpt2_source, CASES[case], output)
    _streamed(gpt2_source, CASES[case], output, resume=True)  # block 0 read back into its `Conv1D` layers
    _same_checkpoint(expected, output)


def test_resume_refuses_other_options_in_one_line(sources, tmp_path, monkeypatch):
    output = tmp_path / "out"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "model.layers.0")
        with pytest.raises(_Stop):
            _streamed(sources["fp32"], CASES["gptq"], output)
    with pytest.raises(ResumeError, match=r"other options \(bits differ\)"):
        _streamed(sources["fp32"], {**CASES["gptq"], "bits": 3}, output, resume=True)
    with pytest.raises(ResumeError, match="another checkpoint"):
        _streamed(sources["tied"], CASES["gptq"], output, resume=True)
    assert len(interrupted_runs(output)) == 1  # refused: left for a resume with the right inputs


def test_resume_refuses_a_damaged_block(sources, tmp_path, monkeypatch):
    output = tmp_path / "out"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "model.layers.0")
        with pytest.raises(_Stop):
            _streamed(sources["fp32"], CASES["rtn"], output)
    [left] = interrupted_runs(output)
    shard = left / "model.safetensors"
    header = json.loads(shard.read_bytes()[8 : 8 + int.from_bytes(shard.read_bytes()[:8], "little")])
    start = (
        8
        + int.from_bytes(shard.read_bytes()[:8], "little")
        + header["model.layers.0.mlp.up_proj.weight"]["data_offsets"][0]
    )
    data = bytearray(shard.read_bytes())
    data[start] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ResumeError, match=r"model\.layers\.0 .* do not match their hash"):
        _streamed(sources["fp32"], CASES["rtn"], output, resume=True)


def test_a_new_run_removes_an_interrupted_one(sources, tmp_path, monkeypatch):
    output = tmp_path / "out"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, "model.layers.0")
        with pytest.raises(_Stop):
            _streamed(sources["fp32"], CASES["rtn"], output)
    notes: list[str] = []
    _streamed(sources["fp32"], CASES["rtn"], output, note=notes.append)
    assert any("--resume would continue it" in note for note in notes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_full_disk_mid_run_keeps_the_finished_blocks_for_resume(sources, tmp_path, monkeypatch):
    import errno
    import os

    from quantlab.streaming import writer

    straight = _streamed(sources["fp32"], CASES["rtn"], tmp_path / "straight")
    output = tmp_path / "out"
    real, complete = os.pwrite, PartialOutput.complete
    finished: list[str] = []

    def filling(handle, data, offset):  # the disk is full once the first block is written
        if finished:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(handle, data, offset)

    def recording(self, name, digest):
        complete(self, name, digest)
        finished.append(name)

    with monkeypatch.context() as patch:
        patch.setattr(writer.os, "pwrite", filling)
        patch.setattr(PartialOutput, "complete", recording)
        with pytest.raises(OSError, match="No space left"):
            _streamed(sources["fp32"], CASES["rtn"], output)
    assert not output.exists() and len(interrupted_runs(output)) == 1
    _streamed(sources["fp32"], CASES["rtn"], output, resume=True)
    _same_checkpoint(straight, output)


def test_offloaded_activations_give_the_same_checkpoint_and_leave_no_files(sources, tmp_path):
    expected = _streamed(sources["fp32"], CASES["awq+gptq"], tmp_path / "in-memory")
    offload = tmp_path / "activations"
    _same_checkpoint(expected, _streamed(sources["fp32"], CASES["awq+gptq"], tmp_path / "out", offload_dir=offload))
    assert list(offload.iterdir()) == []


def test_calibrating_a_model_without_a_tokenizer_says_what_to_do(sources, tmp_path):
    source = tmp_path / "no-tokenizer"
    tiny_llama(0).save_pretrained(source)
    hf_config = read_config(source)
    config = quantlab.CustomBitsConfig(**CASES["gptq"])
    with pytest.raises(quantlab.QuantizationError, match=r"has no tokenizer .* --self-calibration"):
        quantize_checkpoint(source, hf_config, model_class(hf_config), config, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-tokenizer"]
