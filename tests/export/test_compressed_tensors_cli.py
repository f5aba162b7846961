"""`quantlab export compressed-tensors` end to end on tiny checkpoints, in process."""

import json

import pytest

import quantlab
from quantlab.cli.main import main
from quantlab.testing import tiny_llama, tiny_llama_checkpoint


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _checkpoint(tmp_path_factory, name: str, config) -> object:
    model = tiny_llama() if config is None else quantlab.quantize(tiny_llama(), config)
    return tiny_llama_checkpoint(tmp_path_factory.mktemp(name) / name, model=model)


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float16")
    return _checkpoint(tmp_path_factory, "int4", config)


def test_json_report_lists_every_layer(capsys, int4_dir, tmp_path) -> None:
    output = tmp_path / "out"
    code, out, _ = _run(capsys, "export", "compressed-tensors", int4_dir, "-o", output, "--json")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["command"] == "export compressed-tensors" and report["format"] == "pack-quantized"
    assert report["schemes"] == {"int4 g32 sym": 14} and report["ignore"] == ["lm_head"]
    assert report["bytes"] == (output / "model.safetensors").stat().st_size
    assert (output / "tokenizer.json").is_file()


def test_text_report(capsys, int4_dir, tmp_path) -> None:
    code, out, _ = _run(capsys, "export", "compressed-tensors", int4_dir, "-o", tmp_path / "text")
    assert code == 0
    assert "14 int4 g32 sym" in out and "lm_head" in out


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (quantlab.NF4Config(), "model.layers.0.self_attn.q_proj (nf4 4-bit) cannot be written as compressed-tensors"),
        (quantlab.CustomBitsConfig(bits=4, group_size=32), "zero points are fractions"),
        (None, "no quantized Linear layer"),
    ],
    ids=["nf4", "fractional-zero", "float"],
)
def test_models_no_scheme_holds_fail_in_one_line_and_write_nothing(
    capsys, tmp_path_factory, tmp_path, config, message
) -> None:
    source = _checkpoint(tmp_path_factory, "bad", config)
    output = tmp_path / "out"
    code, _, err = _run(capsys, "export", "compressed-tensors", source, "-o", output)
    errors = [line for line in err.splitlines() if line.startswith("quantlab: error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_kept_without_overwrite(capsys, int4_dir, tmp_path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    code, _, err = _run(capsys, "export", "compressed-tensors", int4_dir, "-o", output)
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert [p.name for p in output.iterdir()] == ["keep.txt"]
    code, _, _ = _run(capsys, "export", "compressed-tensors", int4_dir, "-o", output, "--overwrite")
    assert code == 0 and (output / "config.json").is_file() and not (output / "keep.txt").exists()
