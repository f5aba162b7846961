"""Pruning: unstructured and N:M magnitude pruning, structured pruning that shrinks layers, sparse storage.

```python
from quantlab.prune import prune, prune_structured, GradualPruning, KeepMasks, save_sparse, load_sparse

prune(model, "2:4")                                 # one-shot; masks attached to the layers
Trainer(model, config, data, callbacks=[KeepMasks()]).train()   # fine-tune, masks held
save_sparse(model, "out/")                          # bitmask + kept values (sizes: benchmarks/RESULTS.md)
model = load_sparse("out/")                         # dense in memory again, masks restored

Trainer(model, config, data, callbacks=[GradualPruning(0.8, end_step=1000)]).train()   # cubic schedule
prune_structured(model, mlp_sparsity=0.25)          # smaller matrices, config updated, plain save_pretrained
```
Prune the float model, then quantize it: `save_sparse` also stores a pruned-then-quantized
model's codes compactly.
"""

from quantlab.prune.codes import CodeLayout
from quantlab.prune.layer_masks import apply_masks, attach_mask, make_permanent, mask_gradients, mask_of, masked_layers
from quantlab.prune.mask_rules import cubic_sparsity, global_magnitude_masks, magnitude_mask, nm_mask
from quantlab.prune.patterns import PruningError, SparsityPattern, check_sparsity, parse_pattern
from quantlab.prune.schedule import GradualPruning, KeepMasks, masked_fraction
from quantlab.prune.storage import (
    SparseStorage,
    is_sparse_checkpoint,
    load_sparse,
    read_sparse_state_dict,
    save_sparse,
    sparse_storage,
)
from quantlab.prune.structured import StructuredResult, prune_structured
from quantlab.prune.targets import prunable_layers
from quantlab.prune.unstructured import PruningResult, compute_masks, prune

__all__ = [
    "CodeLayout",
    "GradualPruning",
    "KeepMasks",
    "PruningError",
    "PruningResult",
    "SparseStorage",
    "SparsityPattern",
    "StructuredResult",
    "apply_masks",
    "attach_mask",
    "check_sparsity",
    "compute_masks",
    "cubic_sparsity",
    "global_magnitude_masks",
    "is_sparse_checkpoint",
    "load_sparse",
    "magnitude_mask",
    "make_permanent",
    "mask_gradients",
    "mask_of",
    "masked_fraction",
    "masked_layers",
    "nm_mask",
    "parse_pattern",
    "prunable_layers",
    "prune",
    "prune_structured",
    "read_sparse_state_dict",
    "save_sparse",
    "sparse_storage",
]
