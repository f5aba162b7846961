"""`quantlab export gguf` end to end on a tiny quantized checkpoint, in process."""

import json

import pytest

pytest.importorskip("gguf")

import quantlab
from quantlab.cli.main import main
from quantlab.testing import tiny_llama, tiny_llama_checkpoint


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    config = quantlab.CustomBitsConfig(bits=4, group_size=32, symmetric=True, scale_dtype="float16")
    model = quantlab.quantize(tiny_llama(), config)
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("q4") / "tiny-q4", model=model)


def test_json_report_lists_every_tensor(capsys, q4_dir, tmp_path) -> None:
    output = tmp_path / "out" / "tiny.gguf"
    code, out, _ = _run(capsys, "export", "gguf", q4_dir, "-o", output, "--json")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["command"] == "export gguf" and report["architecture"] == "llama"
    assert report["bytes"] == output.stat().st_size
    assert report["types"] == {"Q4_0": 14, "Q8_0": 2, "F32": 5}
    assert report["requantized"] == ["token_embd.weight", "output.weight"]
    q_proj = next(t for t in report["tensors"] if t["name"] == "blk.0.attn_q.weight")
    assert q_proj["origin"] == "codes" and q_proj["exact"] and not q_proj["requantized"]


def test_text_report_and_fallback_type(capsys, q4_dir, tmp_path) -> None:
    code, out, _ = _run(capsys, "export", "gguf", q4_dir, "-o", tmp_path / "t.gguf", "--fallback-type", "F32")
    assert code == 0
    assert "from quantlab codes  14 of 16 matrices" in out
    assert "re-quantized         none" in out  # the float tables in F32 hold the model's values
    assert "blk.1.ffn_down.weight" in out and "quantlab codes" in out
    assert "token_embd.weight" in out and "F32" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--exact"], "exact export refused: token_embd.weight"),
        (["--fallback-type", "Q3_K"], "invalid choice"),
    ],
)
def test_bad_requests_fail_in_one_line_and_write_nothing(capsys, q4_dir, tmp_path, extra, message) -> None:
    output = tmp_path / "bad.gguf"
    code, _, err = _run(capsys, "export", "gguf", q4_dir, "-o", output, *extra)
    errors = [line for line in err.splitlines() if line.startswith("quantlab: error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0]
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused(capsys, q4_dir, tmp_path) -> None:
    output = tmp_path / "there.gguf"
    output.write_bytes(b"keep")
    code, _, err = _run(capsys, "export", "gguf", q4_dir, "-o", output)
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert output.read_bytes() == b"keep"
    code, _, _ = _run(capsys, "export", "gguf", q4_dir, "-o", output, "--overwrite", "--quiet")
    assert code == 0 and output.read_bytes()[:4] == b"GGUF"


def test_the_commands_fallback_types_are_the_exporters() -> None:
    from quantlab.cli.export import GGUF_FALLBACK_TYPES
    from quantlab.export.gguf import FALLBACK_TYPES

    assert GGUF_FALLBACK_TYPES == FALLBACK_TYPES
