"""`--embedding-bits` through `quantize`, `inspect` and `eval`."""

from pathlib import Path

import pytest


def _quantize(cli, source: Path, output: Path, *flags: str) -> dict:
    result = cli.run("quantize", source, "--method", "nf4", *flags, "--output", output, "--json")
    assert result.returncode == 0, result.stderr
    return result.json()


def test_embedding_bits_shrinks_the_file_not_the_linear_layers_bits(
    cli, nf4_llama, llama_dir: Path, tmp_path: Path
) -> None:
    plain = nf4_llama.result.json()
    embedded = _quantize(cli, llama_dir, tmp_path / "embedded", "--embedding-bits", "8")
    assert embedded["config"]["embedding_bits"] == 8
    # Bits per weight count the quantized Linear layers only; the tables change the file.
    assert embedded["bits_per_quantized_weight"] == plain["bits_per_quantized_weight"]
    assert embedded["parameters"] == plain["parameters"] == 131_392
    # Two 256 x 64 float32 tables (embedding and untied head) become int8 plus float16 scales per 64.
    saved = 2 * (256 * 64 * 4 - (256 * 64 + 256 * 2))
    assert plain["size_after_bytes"] - embedded["size_after_bytes"] == pytest.approx(saved, abs=2048)
    assert embedded["layers_kept"] == [] and plain["tables_quantized"] == []
    assert embedded["tables_quantized"] == ["model.embed_tokens (8-bit)", "lm_head (8-bit)"]

    inspected = cli.run("inspect", tmp_path / "embedded", "--reference", llama_dir, "--json")
    assert inspected.returncode == 0, inspected.stderr
    report = inspected.json()
    assert report["file_bytes"] == (tmp_path / "embedded" / "model.safetensors").stat().st_size
    assert [layer["name"] for layer in report["layers"] if "lm_head" in layer["name"]] == []
    tables = {row["name"]: row for row in report["tables"]}
    assert set(tables) == {"model.embed_tokens", "lm_head"}
    for row in tables.values():
        assert (row["method"], row["bits"], row["group_size"], row["shape"]) == ("int8", 8, 64, [256, 64])
        assert row["stored_bytes"] == 256 * 64 + 256 * 2
        assert 0 < row["relative_error"] < 0.01  # int8 on float weights

    text = cli.run("inspect", tmp_path / "embedded")
    assert text.returncode == 0, text.stderr
    assert "vocabulary tables" in text.stdout and "whole file:" in text.stdout

    evaluated = cli.run("eval", tmp_path / "embedded", *cli.tiny_eval, "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.json()["bits_per_quantized_weight"] == plain["bits_per_quantized_weight"]
    assert evaluated.json()["size_bytes"] == embedded["size_after_bytes"]
    assert evaluated.json()["tables_quantized"] == embedded["tables_quantized"]


def test_bad_embedding_bits_is_one_line_and_exit_2(cli, llama_dir: Path, tmp_path: Path) -> None:
    result = cli.run("quantize", llama_dir, "--method", "nf4", "--embedding-bits", "2", "--output", tmp_path / "x")
    cli.assert_user_error(result, "embedding_bits=2 is not valid", "from 4 to 8")
