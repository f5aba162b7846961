"""Fixtures for the fault-injection suite: a tiny LoRA run with a checkpoint, and a pickle payload.

The payload is a real one: unpickling it creates a marker folder (`os.mkdir`), so a test that
plants it can tell whether anything ever unpickled it.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from quantlab.testing import tiny_llama
from quantlab.training import TokenSequences, Trainer, add_lora, training_arguments
from quantlab.training.checkpoints import file_digest


class Payload:
    """Runs `os.mkdir(marker)` when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@dataclass
class PickleBomb:
    marker: Path
    torch_file: bytes  # what `torch.save` writes: a zip around the pickle

    def ran(self) -> bool:
        return self.marker.exists()


@pytest.fixture
def pickle_bomb(tmp_path: Path) -> PickleBomb:
    marker = tmp_path / "payload-ran"
    saved = tmp_path / "payload.pt"
    torch.save(Payload(marker), saved)
    torch.load(saved, weights_only=False)  # the payload is live: loading it the unsafe way runs it
    assert marker.exists()
    marker.rmdir()
    return PickleBomb(marker, saved.read_bytes())


def lora_model(alpha: float = 8.0, dropout: float = 0.1):
    torch.manual_seed(0)
    model = tiny_llama(0)
    model.requires_grad_(False)
    torch.manual_seed(1)
    return add_lora(model, r=4, alpha=alpha, dropout=dropout, init_lora_weights=False)


def token_data() -> TokenSequences:
    pattern = torch.arange(40) % 13 + 10
    return TokenSequences([pattern[i % 5 : i % 5 + 12 + i % 7] for i in range(24)])


def run_config(output_dir: Path, **overrides):
    options = {"max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "save_steps": 2}
    options.update(output_dir=str(output_dir), save_total_limit=2, disable_tqdm=True, **overrides)
    return training_arguments(options)


@dataclass
class SavedRun:
    """A 4-step run with checkpoints at steps 2 and 4, and the adapters it ended with."""

    folder: Path
    final: dict[str, torch.Tensor]

    @property
    def checkpoint(self) -> Path:
        return self.folder / "checkpoint-2"

    def copy(self, destination: Path) -> "SavedRun":
        shutil.copytree(self.folder, destination)
        return SavedRun(destination, self.final)

    def resume(self, model_options: dict | None = None, **overrides) -> Trainer:
        """Resume from step 2 and finish the run."""
        trainer = Trainer(lora_model(**(model_options or {})), run_config(self.folder, **overrides), token_data())
        trainer.train(resume_from_checkpoint=self.checkpoint)
        return trainer


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> SavedRun:
    folder = tmp_path_factory.mktemp("run") / "run"
    model = lora_model()
    Trainer(model, run_config(folder), token_data()).train()
    final = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return SavedRun(folder, final)


@pytest.fixture
def run_copy(saved_run: SavedRun, tmp_path: Path) -> SavedRun:
    return saved_run.copy(tmp_path / "run")


def forge_checksum(checkpoint: Path, name: str) -> None:
    """Record the current size and checksum of `name` in the checkpoint's manifest, as a careful forger would."""
    manifest_file = checkpoint / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"][name] = file_digest(checkpoint / name)
    manifest_file.write_text(json.dumps(manifest))


@pytest.fixture
def forge():
    return forge_checksum


# -- the command line -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantlab.testing import byte_tokenizer, tiny_llama_checkpoint

    return tiny_llama_checkpoint(tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer=byte_tokenizer())


@pytest.fixture(scope="session")
def train_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 80)
    return path


def finetune_argv(model: Path, text: Path, output: Path, *extra: str) -> list[str]:
    """A 4-step LoRA run on the tiny Llama with checkpoints at steps 2 and 4, no evaluation."""
    return [
        "finetune", str(model), "--max-steps", "4", "--output-dir", str(output), "--data", str(text),
        "--lora-r", "4", "--max-seq-length", "32", "--eval-windows", "0", "--learning-rate", "1e-2",
        "--save-steps", "2", "--quiet", *extra,
    ]  # fmt: skip


@pytest.fixture
def finetune_args():
    return finetune_argv


@pytest.fixture(scope="session")
def finetune_run(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path, train_text: Path) -> Path:
    from quantlab.cli.main import main

    output = tmp_path_factory.mktemp("finetune") / "run"
    assert main(finetune_argv(llama_dir, train_text, output)) == 0
    return output
