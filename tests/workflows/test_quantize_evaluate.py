"""The quantize and evaluate workflows called from Python: reports, files written, inputs untouched."""

import json
from pathlib import Path

import pytest

import quantlab
from quantlab.errors import QuantlabError
from quantlab.utils.atomic import OutputExistsError
from quantlab.workflows.evaluate import evaluate_checkpoint
from quantlab.workflows.quantize import QuantizeReport, quantize_to_checkpoint


@pytest.fixture(scope="module")
def quantized(llama_dir: Path, tiny_text, tmp_path_factory: pytest.TempPathFactory) -> tuple[QuantizeReport, list[str]]:
    """The tiny Llama quantized to NF4 and evaluated, with the notes the workflow sent."""
    notes: list[str] = []
    output = tmp_path_factory.mktemp("quantized") / "nf4"
    report = quantize_to_checkpoint(
        llama_dir, quantlab.NF4Config(blocksize=32), output, evaluate=tiny_text, notify=notes.append
    )
    return report, notes


def test_the_report_describes_the_checkpoint_written(quantized, llama_dir: Path) -> None:
    report, notes = quantized
    output = Path(report.output)
    assert (report.method, report.layers_quantized, report.layers_kept) == ("nf4", 14, ["lm_head"])
    assert report.model_path == str(llama_dir.resolve())
    assert report.config["blocksize"] == 32
    assert report.size_after_bytes < report.size_before_bytes
    assert report.perplexity_before is not None and report.perplexity_after is not None
    assert report.evaluation_text == "2 x 64 tokens of the bundled WikiText-2 text"
    saved = json.loads((output / "quantlab_report.json").read_text())
    assert saved["perplexity_after"] == report.perplexity_after
    assert any(note.startswith("quantizing ") for note in notes)
    assert any(note.startswith("measuring perplexity") for note in notes)


def test_evaluate_reproduces_the_perplexity_of_the_checkpoint(quantized, tiny_text) -> None:
    report, _ = quantized
    evaluated = evaluate_checkpoint(report.output, tiny_text)
    assert evaluated.perplexity == report.perplexity_after
    assert evaluated.quantization == "quantlab_nf4"
    assert (evaluated.layers_quantized, evaluated.layers_kept) == (14, 1)
    assert evaluated.size_bytes == report.size_after_bytes
    assert evaluated.tokens == 128


def test_an_already_quantized_model_is_refused_before_anything_is_written(quantized, tmp_path: Path) -> None:
    report, _ = quantized
    with pytest.raises(QuantlabError, match=r"is already quantized \(quantlab_nf4\); quantize its float original"):
        quantize_to_checkpoint(report.output, quantlab.NF4Config(), tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_an_existing_output_is_kept_without_overwrite(llama_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "taken"
    output.mkdir()
    (output / "mine.txt").write_text("keep")
    with pytest.raises(OutputExistsError, match="already exists; pass --overwrite"):
        quantize_to_checkpoint(llama_dir, quantlab.NF4Config(), output)
    assert [path.name for path in output.iterdir()] == ["mine.txt"]


def test_the_input_model_is_never_the_output(llama_dir: Path) -> None:
    with pytest.raises(QuantlabError, match="is the input"):
        quantize_to_checkpoint(llama_dir, quantlab.NF4Config(), llama_dir, overwrite=True)
    assert (llama_dir / "config.json").is_file()


def test_a_safetensors_model_is_quantized_streamed_with_its_predicted_peak(quantized) -> None:
    report, _ = quantized
    assert report.streamed
    terms = report.predicted_memory_terms
    assert report.predicted_peak_memory_bytes > report.memory_before_load_bytes == terms["before loading"]
    assert terms["one float block"] > terms["its stored tensors"] > 0
    saved = json.loads((Path(report.output) / "quantlab_report.json").read_text())
    assert saved["predicted_peak_memory_bytes"] == report.predicted_peak_memory_bytes


def test_a_checkpoint_in_bin_files_is_loaded_whole_instead(tmp_path: Path) -> None:
    import torch

    from quantlab.testing import byte_tokenizer, tiny_llama

    source = tmp_path / "bin-model"
    model = tiny_llama(0)
    model.config.save_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")
    byte_tokenizer().save_pretrained(source)
    notes: list[str] = []
    report = quantize_to_checkpoint(source, quantlab.Int8SymmetricConfig(), tmp_path / "out", notify=notes.append)
    assert not report.streamed and report.predicted_peak_memory_bytes is None
    assert any("reading the whole model first" in note for note in notes), notes
    assert (tmp_path / "out" / "model.safetensors").is_file()
