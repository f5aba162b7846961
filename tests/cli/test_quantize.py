"""`quantlab quantize` end to end in process; the checkpoint's reload and the entry points in a fresh one."""

import json
import math
import sys
from pathlib import Path

import pytest

RELOAD_IN_NEW_PROCESS = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
layers = [type(m).__name__ for m in model.modules() if hasattr(m, "stored_bytes")]
ids = torch.tensor([tokenizer("Hello quantized world")["input_ids"]])
logits = model(ids).logits
print(len(layers), sorted(set(layers)), bool(torch.isfinite(logits).all()))
"""


def test_quantize_writes_a_checkpoint_and_a_json_report(quantized_llama) -> None:
    report = quantized_llama.result.json()
    assert report["command"] == "quantize"
    assert report["method"] == "custom_bits"
    assert report["config"]["bits"] == 3 and report["config"]["group_size"] == 32
    assert report["layers_quantized"] == 14
    assert report["layers_kept"] == ["lm_head"]
    assert report["parameters"] == 131_392  # the tiny Llama's parameters, quantized or not
    # 3-bit codes plus a float16 scale and zero point per 32 weights: 3 + 32/32 bits.
    assert report["bits_per_quantized_weight"] == pytest.approx(4.0)
    assert report["size_after_bytes"] < 0.5 * report["size_before_bytes"]
    assert report["peak_memory_bytes"] > 0
    assert math.isfinite(report["perplexity_before"]) and math.isfinite(report["perplexity_after"])
    assert report["perplexity_after"] != report["perplexity_before"]
    assert report["padded_groups"] == {}  # groups of 32 divide 64 and 192 inputs
    files = {path.name for path in quantized_llama.output.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "quantlab_report.json"} <= files
    saved = json.loads((quantized_llama.output / "quantlab_report.json").read_text())
    assert saved["perplexity_after"] == report["perplexity_after"]


def _reload(folder: Path) -> str:
    """What RELOAD_IN_NEW_PROCESS prints, computed in this process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    layers = [type(m).__name__ for m in model.modules() if hasattr(m, "stored_bytes")]
    ids = torch.tensor([tokenizer("Hello quantized world")["input_ids"]])
    logits = model(ids).logits
    return f"{len(layers)} {sorted(set(layers))} {bool(torch.isfinite(logits).all())}"


@pytest.mark.subprocess
def test_the_checkpoint_reloads_in_a_new_process_with_its_tokenizer(cli, quantized_llama) -> None:
    result = cli.python(RELOAD_IN_NEW_PROCESS, quantized_llama.output)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "14 ['CustomBitsLinear'] True"


def test_no_temporary_folder_is_left_beside_the_output(quantized_llama) -> None:
    assert [path.name for path in quantized_llama.output.parent.iterdir()] == [quantized_llama.output.name]


def test_the_report_table_is_printed_without_progress_bars_when_stderr_is_a_pipe(
    cli, llama_dir: Path, tmp_path: Path
) -> None:
    result = cli.run("quantize", llama_dir, "--method", "nf4", "--output", tmp_path / "out", "--eval", *cli.tiny_eval)
    assert result.returncode == 0, result.stderr
    for label in ("layers", "parameters", "stored bits", "size on disk", "time", "peak memory", "perplexity"):
        assert f"\n  {label} " in result.stdout, label
    assert "14 quantized, 1 kept in float (lm_head)" in result.stdout
    assert "%|" not in result.stderr  # no tqdm bar
    assert "quantizing" in result.stderr  # the notes still go to stderr


def test_overwrite_replaces_an_existing_output(cli, llama_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "out"
    output.mkdir()
    (output / "old.txt").write_text("previous run")
    result = cli.run("quantize", llama_dir, "--method", "int8", "--output", output, "--overwrite", "--quiet")
    assert result.returncode == 0, result.stderr
    assert not (output / "old.txt").exists()
    assert (output / "model.safetensors").is_file()
    assert result.stderr == ""  # --quiet: nothing but the report


def test_a_gguf_file_is_dequantized_then_quantized(cli, gguf_file: Path, tmp_path: Path) -> None:
    output = tmp_path / "from-gguf"
    result = cli.run("quantize", gguf_file, "--method", "nf4", "--output", output, "--eval", *cli.tiny_eval, "--json")
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["layers_quantized"] == 14
    assert report["size_before_bytes"] == gguf_file.stat().st_size
    assert math.isfinite(report["perplexity_after"])
    assert _reload(output) == "14 ['NF4Linear'] True"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["from-gguf"]  # the float copy is gone


def test_an_encoder_is_quantized_through_its_own_class(cli, bert_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "bert-int8"
    result = cli.run("quantize", bert_dir, "--method", "int8", "--group-size", "32", "--output", output, "--json")
    assert result.returncode == 0, result.stderr
    assert result.json()["layers_quantized"] == 13  # 2 x (q, k, v, o, up, down) + pooler
    from transformers import AutoModel

    assert type(AutoModel.from_pretrained(output)).__name__ == "BertModel"


def test_eval_on_an_encoder_reports_its_embeddings_cosine_to_the_float_model(tmp_path: Path, capsys) -> None:
    from quantlab.cli.main import main
    from quantlab.testing import tiny_bert, tiny_llama_checkpoint

    encoder = tiny_llama_checkpoint(tmp_path / "float", model=tiny_bert(0))  # saved with a byte tokenizer
    reports = {}
    for bits in (8, 2):
        argv = ["quantize", str(encoder), "--method", "custom_bits", "--bits", str(bits), "--group-size", "32",
                "--symmetric", "--eval", "-o", str(tmp_path / f"q{bits}")]  # fmt: skip
        assert main(argv) == 0
        printed = capsys.readouterr().out
        assert "embeddings" in printed and "perplexity" not in printed
        reports[bits] = json.loads((tmp_path / f"q{bits}" / "quantlab_report.json").read_text())
    for report in reports.values():
        assert report["perplexity_after"] is None and report["evaluation_text"].startswith("the first 256 ")
        assert 0 < report["embedding_cosine_worst"] <= report["embedding_cosine_mean"] <= 1
    assert reports[8]["embedding_cosine_mean"] > 0.999 > reports[2]["embedding_cosine_mean"]


def test_modules_to_not_convert_keeps_layers_in_float(cli, llama_dir: Path, tmp_path: Path) -> None:
    result = cli.run(
        "quantize", llama_dir, "--method", "nf4", "--modules-to-not-convert", "lm_head,down_proj",
        "--output", tmp_path / "out", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["layers_quantized"] == 12
    assert sorted(report["layers_kept"]) == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


@pytest.mark.subprocess
def test_the_console_script_and_python_dash_m_run_the_same_command(cli) -> None:
    result = cli.command([sys.executable, "-m", "quantlab.cli", "methods", "--json"])
    assert result.returncode == 0, result.stderr
    assert {"custom_bits", "int8", "nf4"} <= {method["name"] for method in result.json()["methods"]}
    script = Path(sys.executable).with_name("quantlab")
    if not script.is_file():
        pytest.skip("the quantlab console script is not installed beside this Python")
    wrong = cli.command([script, "quantize", "--method", "nf4"])
    cli.assert_user_error(wrong, "the following arguments are required: --output/-o")


def test_a_group_size_that_does_not_divide_the_inputs_is_reported(cli, llama_dir: Path, tmp_path: Path) -> None:
    """64 and 192 inputs in groups of 128 store 128 and 256 codes a row: the report and the table say so."""
    result = cli.run("quantize", llama_dir, "--method", "custom_bits", "--group-size", "128", "-o", tmp_path / "q")
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "q" / "quantlab_report.json").read_text())
    assert saved["padded_groups"]["model.layers.0.self_attn.q_proj"] == [64, 128, 128]
    assert saved["padded_groups"]["model.layers.0.mlp.down_proj"] == [192, 128, 256]
    assert len(saved["padded_groups"]) == 14
    assert "with a padded last group (model.layers.0.self_attn.q_proj: 64 inputs in groups of 128" in result.stdout


def test_rotate_inputs_from_the_command_line_and_a_name_that_matches_nothing(cli, llama_dir, tmp_path) -> None:
    output = tmp_path / "rotated"
    args = ("quantize", llama_dir, "--method", "custom_bits", "--bits", "4", "--group-size", "32", "--output")
    result = cli.run(*args, output, "--rotate-inputs", "down_proj", "--json")
    assert result.returncode == 0, result.stderr
    assert result.json()["config"]["rotate_inputs"] == ["down_proj"]
    config = json.loads((output / "config.json").read_text())
    assert config["quantization_config"]["rotate_inputs"] == ["down_proj"]
    refused = cli.run(*args, tmp_path / "never", "--rotate-inputs", "down_prj")
    cli.assert_user_error(refused, "rotate_inputs=['down_prj'] matches no layer", notes_before=True)
    assert not (tmp_path / "never").exists()
