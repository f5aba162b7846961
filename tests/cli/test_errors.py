"""Bad input: one line on stderr starting `quantlab: error:`, exit code 2, no traceback, no output folder."""

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import quantlab
from quantlab.cli.main import main
from quantlab.testing import byte_tokenizer, tiny_llama
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
    save_file({"weight": torch.zeros(2)}, tmp_path / "odd" / "model.safetensors")
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


def test_quantize_eval_on_an_encoder_decoder_fails_before_writing(tmp_path: Path, capsys) -> None:
    from transformers import T5Config, T5Model

    from quantlab.cli.main import main
    from quantlab.testing import tiny_model_dir

    folder = tiny_model_dir(T5Model(T5Config(num_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16)), tmp_path / "t5")
    code = main(["quantize", str(folder), "--method", "int8", "--output", str(tmp_path / "out"), "--eval"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "quantize it without --eval" in err and "T5Model" in err
    assert not (tmp_path / "out").exists()


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


@pytest.fixture(scope="module")
def symmetric_4bit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama in symmetric 4-bit groups of 32: every export format holds its codes."""
    directory = tmp_path_factory.mktemp("models") / "llama-4bit"
    model = tiny_llama()
    quantlab.quantize(model, quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True))
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("kind", "name"), [("gguf", "m.gguf"), ("onnx", "m.onnx"), ("compressed-tensors", "ct")])
def test_a_full_disk_during_an_export_is_one_line(cli, symmetric_4bit: Path, tiny_disk: Path, kind, name) -> None:
    result = cli.run("export", kind, symmetric_4bit, "--output", tiny_disk / name, "--quiet")
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


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nan", "--target-bits expects a finite number or 'none', got 'nan'"),
        ("inf", "--target-bits expects a finite number or 'none', got 'inf'"),
        ("-2", "target_bits=-2.0 is not valid"),
        ("0", "target_bits=0.0 is not valid"),
        ("1.0", "target_bits=1 is outside what the candidate widths can store on this model (2.250 to"),
        ("40", "target_bits=40 is outside what the candidate widths can store"),
    ],
)
@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "loaded"])
def test_a_bad_bit_budget_is_refused_before_any_calibration(
    cli, llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, message: str, streamed: bool
) -> None:
    import quantlab.calibration.model
    import quantlab.streaming.quantize
    import quantlab.workflows.quantize
    from quantlab.streaming.reader import NotStreamableError

    def no_calibration(*args: object, **kwargs: object) -> None:
        raise AssertionError("calibration text was made before the budget was checked")

    monkeypatch.setattr(quantlab.calibration.model, "windows_for", no_calibration)
    monkeypatch.setattr(quantlab.streaming.quantize, "windows_for", no_calibration)
    if not streamed:  # a whole load, as for a model with no safetensors file to stream

        def not_streamable(*args: object, **kwargs: object) -> None:
            raise NotStreamableError("a test asks for a whole load")

        monkeypatch.setattr(quantlab.workflows.quantize, "_quantize_streamed", not_streamable)
    result = cli.run("quantize", llama_dir, "--method", "custom_bits", "--target-bits", value, "-o", tmp_path / "o")
    cli.assert_user_error(result, message, notes_before=True)
    assert not (tmp_path / "o").exists()


def _foreign_checkpoint(llama_dir: Path, folder: Path, quantization: object) -> Path:
    import json
    import shutil

    shutil.copytree(llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "aqlm"},
         "was quantized by another library (quant_method='aqlm'), which quantlab does not read"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
         "says awq but stores no quantized layer"),
        ({"quant_method": "quanto", "weights": "int8"},
         "was quantized by another library (quant_method='quanto'), which quantlab does not read"),
        ("awq", "quantization_config must be an object with a quant_method string, not \"awq\""),
        ({"bits": 4}, "quantization_config must be an object with a quant_method string"),
    ],
    ids=["aqlm", "awq without its tensors", "quanto", "a string", "no quant_method"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["eval", "inspect"])
def test_a_checkpoint_of_another_library_is_one_line(
    cli, llama_dir: Path, tmp_path: Path, quantization: object, message: str, command: str
) -> None:
    import importlib.util

    if isinstance(quantization, dict):
        package = {"aqlm": "aqlm", "quanto": "optimum.quanto"}.get(quantization.get("quant_method"))
        if package and importlib.util.find_spec(package) is not None:
            pytest.skip(f"{package} is installed here: transformers loads the checkpoint")
    folder = _foreign_checkpoint(llama_dir, tmp_path / "foreign", quantization)
    cli.assert_user_error(cli.run(command, folder), message, notes_before=True)


@pytest.mark.parametrize("command", ["quantize", "eval", "inspect"])
def test_remote_code_in_a_model_folder_is_never_run(cli, llama_dir: Path, tmp_path: Path, command: str) -> None:
    """A config's `auto_map` names Python files of the folder; quantlab never imports them."""
    import json
    import shutil

    folder = tmp_path / "remote"
    shutil.copytree(llama_dir, folder)
    marker = tmp_path / "ran"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil", architectures=["EvilModel"])
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    argv = [command, folder] + (["--method", "int8", "-o", tmp_path / "out"] if command == "quantize" else [])
    cli.assert_user_error(cli.run(*argv), f"{folder} is not a model transformers can load", notes_before=True)
    assert not marker.exists() and not (tmp_path / "out").exists()
