"""Pruning on the real SmolLM2-135M weights: storage sizes and reloads (no training, no perplexity)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantlab.prune import load_sparse, prune, prune_structured, save_sparse, sparse_storage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from quantlab.assets.models import smollm2_dir

    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()


@pytest.mark.parametrize(("pattern", "sparsity"), [("unstructured", 0.5), ("2:4", None)])
def test_half_sparse_smollm2_stores_its_linear_weights_in_at_most_0_6x(tmp_path, smollm2, pattern, sparsity):
    import copy

    model = copy.deepcopy(smollm2)
    prune(model, pattern, sparsity)
    save_sparse(model, tmp_path / "sparse")
    storage = sparse_storage(tmp_path / "sparse")
    assert storage.ratio() <= 0.6  # half the values plus a record of where they sit
    assert storage.file_bytes < 0.7 * storage.dense_bytes  # the tied embeddings stay dense
    reloaded = load_sparse(tmp_path / "sparse")
    layer, again = model.model.layers[7].mlp.down_proj, reloaded.model.layers[7].mlp.down_proj
    assert torch.equal(layer.weight, again.weight)
    x = torch.tensor([[1, 504, 3458, 314, 260, 1345]])
    with torch.inference_mode():
        torch.testing.assert_close(reloaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_structured_smollm2_reloads_as_a_smaller_llama(tmp_path, smollm2):
    import copy

    model = copy.deepcopy(smollm2)
    result = prune_structured(model, mlp_sparsity=0.25)
    assert result.intermediate_size == (1536, 1152)
    model.save_pretrained(tmp_path / "small")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "small")
    assert reloaded.config.intermediate_size == 1152
    x = torch.tensor([[1, 504, 3458, 314, 260, 1345]])
    with torch.inference_mode():
        torch.testing.assert_close(reloaded(x).logits, model(x).logits)
