"""Bad input: one line on stderr starting `quantlab: error:`, exit code 2, no traceback, no output folder."""

import errno
import os
from pathlib import Path

import pytest

from quantlab.cli.main import main
from quantlab.testing.disks import small_tmpfs


def test_missing_model_path(cli, tmp_path: Path) -> None:
    result = cli.run("quantize", tmp_path / "nowhere", "--method", "nf4", "--output", tmp_path / "out")
    cli.assert_user_error(result, "nowhere does not exist")
    assert not (tmp_path / "out").exists()


def test_folder_that_is_not_a_model(cli, tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    result = cli.run("quantize", tmp_path / "notes", "--method", "nf4", "--output", tmp_path / "out")
    cli.assert_user_error(result, "not a Hugging Face model folder: it has no config.json")


def test_config_json_that_transformers_cannot_read(cli, tmp_path: Path) -> None:
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (tmp_path / "odd" / "model.safetensors").write_bytes(b"")
    result = cli.run("eval", tmp_path / "odd")
    cli.assert_user_error(result, "is not a model transformers can load")


def test_a_file_that_is_not_gguf(cli, tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    result = cli.run("quantize", tmp_path / "weights.bin", "--method", "nf4", "--output", tmp_path / "out")
    cli.assert_user_error(result, "neither a model folder nor a .gguf file")


def test_unknown_method_lists_the_known_ones(cli, llama_dir: Path, tmp_path: Path) -> None:
    result = cli.run("quantize", llama_dir, "--method", "nf5", "--output", tmp_path / "out")
    cli.assert_user_error(result, "unknown quantization method 'nf5'", "custom_bits", "int8", "nf4")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--method", "custom_bits", "--bits", "9"], "bits=9 is not valid; use a whole number from 2 to 8"),
        (["--method", "custom_bits", "--group-size", "48"], "group_size=48 is not valid; use a power of two"),
        (["--method", "custom_bits", "--bits", "three"], "--bits expects a whole number, got 'three'"),
        (["--method", "int8", "--scale-dtype", "float8"], "scale_dtype='float8' is not valid; choose one of"),
        (["--method", "nf4", "--bits", "3"], "--bits is not an option of method 'nf4' (--bits is an option of"),
    ],
)
def test_invalid_option_values(cli, llama_dir: Path, tmp_path: Path, flags: list[str], message: str) -> None:
    result = cli.run("quantize", llama_dir, *flags, "--output", tmp_path / "out")
    cli.assert_user_error(result, message)
    assert not (tmp_path / "out").exists()


def test_missing_required_flag_is_one_line_too(cli, llama_dir: Path) -> None:
    result = cli.run("quantize", llama_dir, "--method", "nf4")
    cli.assert_user_error(result, "the following arguments are required: --output/-o", "quantlab quantize --help")


def test_existing_output_without_overwrite_is_left_alone(cli, llama_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    result = cli.run("quantize", llama_dir, "--method", "nf4", "--output", output)
    cli.assert_user_error(result, "already exists; pass --overwrite")
    assert [path.name for path in output.iterdir()] == ["keep.txt"]


def test_quantizing_a_quantized_checkpoint(cli, quantized_llama, tmp_path: Path) -> None:
    result = cli.run("quantize", quantized_llama.output, "--method", "nf4", "--output", tmp_path / "out")
    cli.assert_user_error(result, "is already quantized (quantlab_custom_bits)")


def test_eval_needs_a_causal_lm(cli, bert_dir: Path) -> None:
    cli.assert_user_error(cli.run("eval", bert_dir), "needs a causal language model", "BertModel")


def test_quantize_eval_on_an_encoder_fails_before_writing(cli, bert_dir: Path, tmp_path: Path) -> None:
    result = cli.run("quantize", bert_dir, "--method", "int8", "--output", tmp_path / "out", "--eval")
    cli.assert_user_error(result, "quantize it without --eval")
    assert list(tmp_path.iterdir()) == []


def test_eval_needs_a_tokenizer(cli, tmp_path: Path) -> None:
    from quantlab.testing import tiny_llama, tiny_model_dir

    folder = tiny_model_dir(tiny_llama(), tmp_path / "no-tokenizer")
    cli.assert_user_error(cli.run("eval", folder), "has no tokenizer, which perplexity needs")


def test_eval_text_file_that_does_not_exist(cli, llama_dir: Path, tmp_path: Path) -> None:
    cli.assert_user_error(cli.run("eval", llama_dir, "--text", tmp_path / "none.txt"), "none.txt: no such file")


def test_eval_text_too_short_for_the_windows(cli, llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("only a few words")
    result = cli.run("eval", llama_dir, "--text", tmp_path / "short.txt")
    cli.assert_user_error(result, "fewer than the 16 windows of 512 tokens")


def test_inspect_reference_of_another_architecture(cli, quantized_llama, bert_dir: Path) -> None:
    result = cli.run("inspect", quantized_llama.output, "--reference", bert_dir)
    cli.assert_user_error(result, "--reference must be the float model the checkpoint was quantized from")


def test_layer_options_naming_no_layer(cli, llama_dir: Path, tmp_path: Path) -> None:
    options = '{"model.layers.0.mlp.up": {"bits": 8}}'
    result = cli.run("quantize", llama_dir, "--method", "custom_bits", "--layer-options", options, "-o", tmp_path / "q")
    cli.assert_user_error(result, "layer_options names 'model.layers.0.mlp.up'", "correct the name", notes_before=True)
    assert not (tmp_path / "q").exists()


def test_inspect_reference_without_a_report(cli, llama_dir: Path) -> None:
    cli.assert_user_error(cli.run("inspect", llama_dir, "--reference"), "has no quantlab_report.json naming")


# -- a full disk ------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 64 kB tmpfs (needs root and mount; skipped elsewhere): smaller than any tiny checkpoint."""
    with small_tmpfs(tmp_path / "disk", 64) as mountpoint:
        yield mountpoint


@pytest.mark.parametrize("model", ["llama_dir", "gguf_file"])
def test_a_disk_that_fills_up_leaves_no_partial_output(cli, model: str, tiny_disk: Path, request) -> None:
    """A GGUF input fills the disk earlier, while its float copy is written beside the output."""
    result = cli.run("quantize", request.getfixturevalue(model), "--method", "int8", "--output", tiny_disk / "out")
    cli.assert_user_error(result, "no space left on the device", "nothing was written", notes_before=True)
    assert list(tiny_disk.iterdir()) == []


def test_a_full_disk_during_save_is_reported_in_process(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same as above where no tmpfs can be mounted: reserving the output's space fails as on a full disk."""

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("quantlab.streaming.writer.os.posix_fallocate", full_disk)
    code = main(["quantize", str(llama_dir), "--method", "int8", "--output", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "quantlab: error: no space left on the device; nothing was written: free some space or write elsewhere"
    ]
    assert list(tmp_path.iterdir()) == []
