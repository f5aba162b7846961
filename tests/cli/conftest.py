"""Tiny checkpoints (with a byte-level tokenizer) and helpers to run the CLI in this process or a fresh one."""

import contextlib
import io
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from quantlab.testing import byte_tokenizer, tiny_bert, tiny_llama_checkpoint, tiny_model_dir
from quantlab.testing.gguf_files import write_tiny_gguf

# Windows small enough for the tiny Llama (128 positions) and the bundled text.
TINY_EVAL = ["--seq-len", "64", "--windows", "2"]


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "tiny-llama"
    return tiny_llama_checkpoint(directory, tokenizer=byte_tokenizer(eos_and_pad=False))


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tiny_bert(), tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        """The JSON object on the last line of stdout."""
        return json.loads(self.stdout.strip().splitlines()[-1])

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


class Cli:
    """Runs `quantlab.cli.main.main` in this process (stdout and stderr captured, so no progress bars),
    and Python or a console script in a fresh process for what only a new process shows."""

    tiny_eval = TINY_EVAL

    @staticmethod
    def run(*args: str | os.PathLike) -> Completed:
        """`main(ARGS)` in this process, as `quantlab ARGS` runs it; library settings it changes are restored."""
        from transformers.utils import logging as hf_logging

        from quantlab.cli.main import main

        stdout, stderr, verbosity = io.StringIO(), io.StringIO(), hf_logging.get_verbosity()
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                code = main([str(arg) for arg in args])
        finally:
            hf_logging.set_verbosity(verbosity)
        return Completed(code, stdout.getvalue(), stderr.getvalue())

    @staticmethod
    def python(code: str, *args: str | os.PathLike) -> Completed:
        return Cli.command([sys.executable, "-c", code, *map(str, args)])

    @staticmethod
    def command(command: list[str | os.PathLike], env: dict[str, str] | None = None, timeout: float = 900) -> Completed:
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        result = subprocess.run(
            list(map(str, command)), capture_output=True, text=True, env=environment, timeout=timeout
        )
        return Completed(result.returncode, result.stdout, result.stderr)

    @staticmethod
    def assert_user_error(result: Completed, *fragments: str, notes_before: bool = False) -> None:
        """Exit code 2 and one last line on stderr, `quantlab: error: ...`, naming the fragments; no traceback.

        `notes_before`: the command may have printed progress notes before failing; otherwise
        the error must be all of stderr.
        """
        assert result.returncode == 2, (result.returncode, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        lines = result.error_lines
        assert lines and lines[-1].startswith("quantlab: error: "), result.stderr
        if notes_before:
            assert sum(line.startswith("quantlab: error:") for line in lines) == 1, result.stderr
        else:
            assert len(lines) == 1, result.stderr
        for fragment in fragments:
            assert fragment in lines[-1], (fragment, lines[-1])


@pytest.fixture(scope="session")
def cli() -> type[Cli]:
    return Cli


@dataclass
class QuantizeRun:
    output: Path
    result: Completed


@pytest.fixture(scope="session")
def quantized_llama(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> QuantizeRun:
    """The tiny Llama quantized to 3 bits in groups of 32, with --eval, reported as JSON."""
    output = tmp_path_factory.mktemp("quantized") / "llama-3bit"
    result = Cli.run(
        "quantize", llama_dir, "--method", "custom_bits", "--bits", "3", "--group-size", "32",
        "--output", output, "--eval", *TINY_EVAL, "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return QuantizeRun(output, result)


@pytest.fixture(scope="session")
def nf4_llama(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> QuantizeRun:
    """The tiny Llama quantized with nf4's defaults, reported as JSON (shared by the tests that only read it)."""
    output = tmp_path_factory.mktemp("quantized") / "llama-nf4"
    result = Cli.run("quantize", llama_dir, "--method", "nf4", "--output", output, "--json")
    assert result.returncode == 0, result.stderr
    return QuantizeRun(output, result)
