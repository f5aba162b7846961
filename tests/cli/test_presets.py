"""`quantlab quantize --preset NAME`: the preset's settings, flags on top, and a checkpoint that exports to
GGUF with nothing re-quantized. In process: each run is a tiny model."""

import json

import pytest

from quantlab.cli.main import main, parse
from quantlab.testing import tiny_llama_checkpoint

CALIBRATION = ["--calibration-samples", "4", "--calibration-seq-len", "32"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("presets") / "tiny-llama")


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_preset_gives_the_method_and_its_flags(capsys):
    from quantlab.cli.options import config_from_args

    config = config_from_args(parse(["quantize", "--preset", "gguf-q4_0", "--group-size", "64", "--output", "x"]))
    assert (config.method, config.bits, config.group_size, config.symmetric) == ("custom_bits", 4, 64, True)
    code, out, _ = _run(capsys, "quantize", "--preset", "gguf-iq4_nl", "--help")
    assert code == 0 and "iq4_nl options" in out and "gguf-q8_0" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--preset", "gguf-q4_0", "--no-symmetric"], "writes exact GGUF Q4_0, which affine-asym 4-bit codes"),
        (["--preset", "gguf-q4_0", "--method", "nf4"], "quantizes with method 'custom_bits', not 'nf4'"),
        (["--preset", "gguf-q5_k"], "argument --preset: invalid choice: 'gguf-q5_k'"),
        ([], "choose a method with --method NAME (see 'quantlab methods') or a preset with --preset NAME"),
    ],
)
def test_conflicting_or_missing_choices_fail_in_one_line(capsys, llama, tmp_path, flags, message):
    code, _, err = _run(capsys, "quantize", llama, *flags, "--output", tmp_path / "out")
    assert code == 2
    assert err.startswith("quantlab: error:") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("preset", "flags", "kind"),
    [
        ("gguf-iq4_nl", ["--solver", "gptq", *CALIBRATION], "IQ4_NL"),
        ("gguf-q4_0", ["--group-size", "64", "--solver", "gptq", "--awq", *CALIBRATION], "Q4_0"),
        ("gguf-q8_0", [], "Q8_0"),
    ],
)
def test_a_preset_checkpoint_exports_exactly(capsys, llama, tmp_path, preset, flags, kind):
    pytest.importorskip("gguf")
    checkpoint, output = tmp_path / "quantized", tmp_path / "model.gguf"
    code, _, err = _run(capsys, "quantize", llama, "--preset", preset, *flags, "--output", checkpoint, "--quiet")
    assert code == 0, err
    code, out, err = _run(capsys, "export", "gguf", checkpoint, "-o", output, "--exact", "--json")
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["requantized"] == []
    assert report["types"] == {kind: 14, "Q8_0": 2, "F32": 5} if kind != "Q8_0" else {"Q8_0": 16, "F32": 5}
