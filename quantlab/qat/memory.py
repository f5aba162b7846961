"""The peak memory a quantization-aware training run should need, and the choice of what it trains.

    peak = teacher + student + per quantized weight (25 bytes training weights, 1 byte training grids)
           + per trained embedding table entry 12 bytes + activations + logits + scratch + RUNTIME_BYTES

- teacher: its parameters as held (float32, or its Linear weights in bfloat16: `--teacher-weights`);
- student: its tensors as loaded (packed codes, grids, the float embeddings and norms);
- training weights (`train="weights"`): per weight a float latent weight, its offset, the offset's
  gradient, two Adam moments (5 x 4 bytes), the fake quantizer's saved flag and scale gradient (5);
  training grids (`train="grids"`): the codes unpacked (1 byte); the grids' own state is a few numbers
  a group (4 floats and 2 Adam moments per scale and zero point: 1.5 bytes a weight at groups of 32);
- trained embedding tables (`embedding_lr_ratio`): per entry of the tables and a float head, its gradient
  and two Adam moments (12 bytes), and where the heads run in chunks the head's gradient summed over
  them (4 bytes an entry of the head; a head tied to the input table counts once in the tables);
- activations: what the student's backward pass keeps, per token of a micro-batch and block:
  4 bytes x (14 x hidden + 7 x intermediate + heads x sequence length) (Llama-shaped, measured at 135M
  and 1.1B); with activation checkpointing one block's worth plus each block's input;
- logits: per token 3 x vocabulary x 4 bytes (the teacher's, the student's and their gradient:
  `quantlab.distill.chunked_kl`); where the output heads run a chunk of rows at a time
  (`quantlab.distill.chunked_head`), two chunks of 32 MiB;
- scratch: the decoded weight, its gradient and the teacher's weight in float32, each as large as the
  largest layer (`quantlab.utils.scratch`), 4 of them;
- RUNTIME_BYTES: the interpreter, torch and transformers.

`resolve_training` takes "weights" for `train="auto"` where that peak fits `MemAvailable` and
"grids" where it would not. `benchmarks/scale.py --methods qat` compares the formula with measured peaks.
"""

import dataclasses
from typing import Any

from torch import nn

from quantlab.distill.chunked_head import CHUNK_BYTES, PLAIN_HEAD_MODELS
from quantlab.nn import QuantizedLinear
from quantlab.qat.options import QATOptions
from quantlab.qat.swap import embedding_parameters

RUNTIME_BYTES = 400 * 1024**2
WEIGHTS_BYTES_PER_WEIGHT = 25
GRIDS_BYTES_PER_WEIGHT = 1
GRID_STATE_BYTES_PER_GROUP = 2 * 4 * 4  # scale and zero point: value, gradient, two Adam moments
TABLE_BYTES_PER_ENTRY = 3 * 4  # a trained embedding table's gradient and two Adam moments
SCRATCH_COPIES = 4
FITS_SHARE = 0.9  # of the memory available: room for what the formula leaves out


@dataclasses.dataclass(frozen=True)
class TrainingMemory:
    """The predicted peak of one run, in bytes, by term."""

    teacher: int
    student: int
    trained_state: int
    activations: int
    logits: int
    scratch: int

    @property
    def total(self) -> int:
        terms = self.teacher + self.student + self.trained_state + self.activations + self.logits + self.scratch
        return terms + RUNTIME_BYTES

    def terms(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "runtime": RUNTIME_BYTES, "total": self.total}


def predict_peak(
    student: nn.Module,
    teacher: nn.Module,
    train: str,
    batch_size: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    tables_train: bool = False,
) -> TrainingMemory:
    """The peak of training `student` (quantized) against `teacher` with `train` "weights" or "grids";
    `tables_train`: its float embedding tables and head train too."""
    quantized = [m for m in student.modules() if isinstance(m, QuantizedLinear)]
    weights = sum(m.in_features * m.out_features for m in quantized)
    groups = sum(m.layout.out_features * m.layout.groups for m in quantized)
    if train == "weights":
        state = WEIGHTS_BYTES_PER_WEIGHT * weights + GRID_STATE_BYTES_PER_GROUP * groups
    else:
        state = GRIDS_BYTES_PER_WEIGHT * weights + GRID_STATE_BYTES_PER_GROUP * groups
    tokens = batch_size * seq_len
    config = getattr(student, "config", None)
    plain_heads = all(getattr(getattr(m, "config", None), "model_type", None) in PLAIN_HEAD_MODELS
                      for m in (student, teacher))  # fmt: skip
    logits = 2 * CHUNK_BYTES if plain_heads else tokens * 3 * 4 * int(getattr(config, "vocab_size", 0) or 0)
    if tables_train:
        state += _table_state_bytes(student, plain_heads)
    largest = max([m.in_features * m.out_features for m in teacher.modules() if hasattr(m, "in_features")] or [0])
    return TrainingMemory(
        teacher=_tensor_bytes(teacher),
        student=_tensor_bytes(student),
        trained_state=state,
        activations=tokens * _activation_bytes_per_token(config, seq_len, activation_checkpointing),
        logits=logits,
        scratch=SCRATCH_COPIES * 4 * largest,
    )


def resolve_training(
    options: QATOptions,
    student: nn.Module,
    teacher: nn.Module,
    batch_size: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    available: int | None = None,
) -> QATOptions:
    """`options` with `train="auto"` made "weights" or "grids"; a bound on the offsets asks for "weights"."""
    if options.train != "auto":
        return options
    if options.max_offset is not None or not options.learn_scales:
        return dataclasses.replace(options, train="weights")
    available = available_memory() if available is None else available
    tables_train = options.embedding_lr_ratio is not None
    full = predict_peak(student, teacher, "weights", batch_size, seq_len, activation_checkpointing, tables_train)
    fits = available is None or full.total <= FITS_SHARE * available
    return dataclasses.replace(options, train="weights" if fits else "grids")


def available_memory() -> int | None:
    """`MemAvailable` of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _tensor_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen and tensor.device.type != "meta":
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _table_state_bytes(student: nn.Module, chunked_head: bool) -> int:
    tables = {id(p): p.numel() for p in embedding_parameters(student).values()}
    state = TABLE_BYTES_PER_ENTRY * sum(tables.values())
    head = student.get_output_embeddings() if callable(getattr(student, "get_output_embeddings", None)) else None
    if chunked_head and isinstance(head, nn.Module):
        state += 4 * sum(p.numel() for p in head.parameters())
    return state


def _activation_bytes_per_token(config: Any, seq_len: int, checkpointing: bool) -> int:
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    intermediate = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    blocks = int(getattr(config, "num_hidden_layers", 0) or 1)
    block = 4 * (14 * hidden + 7 * intermediate + heads * seq_len)
    if checkpointing:
        return block + blocks * 4 * hidden
    return blocks * block
