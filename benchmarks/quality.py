"""Quality of quantlab's methods on real weights, beside bitsandbytes run in the same process.

SmolLM2-135M-Instruct: perplexity with the shared harness (WikiText-2, 16 windows of 512
tokens; see benchmarks/RESULTS.md), stored bits per quantized weight measured from the saved
safetensors file, checkpoint size, and the time `from_pretrained` takes to load and quantize.
all-MiniLM-L6-v2 (genuine fp32 weights): mean (and worst) cosine similarity of mean-pooled
sentence embeddings to fp32 on the first 256 non-empty WikiText lines, and on the last 256 lines of
the text (beyond the bundled slice everything else reads).

Solvers (round to nearest, data-free mse, GPTQ, AWQ + GPTQ) are crossed with widths and group
sizes, NF4 gets GPTQ (on the bundled text, and self-calibrated: on text the float model
samples itself, which needs no data), and mixed precision is measured at 4.25 / 3.5 / 3.0 / 2.5 bits per
weight. Block-wise reconstruction, learned tables and quantization-aware training (from GPTQ's or
the reconstruction's codes, trained on the bundled text after the evaluation windows, or on the evaluated
text's lines away from both evaluated parts: TRAINING_TEXTS) have rows of their own. Calibrated rows
calibrate on the bundled WikiText-2 from token 8,192 on (SmolLM2; after the evaluation windows) and, for
MiniLM, on the text after its 256 evaluation lines.
Perplexity is also reported on a second, later part of the text (16 x 512 tokens from token
200,000 of the shared file, beyond everything calibration reads). Each row records the peak
resident memory sampled while it loads and quantizes.

Every model is quantized the way users do it, `from_pretrained(..., quantization_config=...)`.
Peer figures (benchmarks/RESULTS.md, "Peer baselines") are printed beside ours where they exist.

    python benchmarks/quality.py                 # everything (10 hours or more on 2 quiet cores; pick rows with --only)
    python benchmarks/quality.py --quick         # a representative subset
    python benchmarks/quality.py --json out.json --text path/to/wiki.test.raw
    python benchmarks/quality.py --only hqq --only bitsandbytes   # some rows (fp32 always runs)
    python benchmarks/quality.py --only "=custom_bits 3-bit g64 sym gptq"   # one row by its exact name
"""

import argparse
import contextlib
import gc
import logging
import math
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import default_text_path, environment, format_table, number, stopwatch, write_json
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

import quantlab
from quantlab.assets.models import minilm_dir, smollm2_dir
from quantlab.assets.text import read_text, text_lines
from quantlab.calibration.data import ENCODER_EVAL_LINES
from quantlab.eval import perplexity
from quantlab.eval.embeddings import EMBEDDING_MAX_TOKENS, embedding_cosines, sentence_embeddings
from quantlab.eval.perplexity import token_ids, window_losses
from quantlab.eval.size import checkpoint_storage

HARNESS_WINDOWS, HARNESS_SEQ_LEN = 16, 512
MINILM_LINES, MINILM_MAX_TOKENS = ENCODER_EVAL_LINES, EMBEDDING_MAX_TOKENS  # sentence-transformers' max_seq_length
LATER_PART_OFFSET = 200_000  # tokens: the second evaluation part, past the bundled text calibration reads


@dataclass(frozen=True)
class Variant:
    """One row: how to build the quantization config, and the peer figure to print beside it."""

    name: str
    family: str  # "float", "quantlab", "plugin" or "bitsandbytes"
    make_config: Callable[[], Any] | None
    peer: tuple[float, str] | None = None
    quick: bool = False
    build: Callable[[Path, Path | None], Any] | None = None  # instead of a config: the model from the float
    # folder (and the calibration text); such a row measures only `model`'s model
    model: str = "smollm2"
    training_text: str | None = None  # the text `build` trains on, its second argument (`training_text_file`)


@dataclass
class Row:
    name: str
    family: str
    perplexity: float | None = None
    cosine_mean: float | None = None
    cosine_min: float | None = None
    bits_per_weight: float | None = None
    checkpoint_mb: float | None = None
    load_seconds: float | None = None
    eval_seconds: float | None = None
    later_perplexity: float | None = None
    later_cosine_mean: float | None = None
    peak_mib: float | None = None
    peer_perplexity: float | None = None
    peer_source: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# -- the variants -------------------------------------------------------------------------


def builtin_variants() -> list[Variant]:
    rtn = "RTN, peer baseline"
    variants = [
        Variant("fp32", "float", None, (36.077, "peer baseline"), quick=True),
        Variant("int8 (per channel)", "quantlab", quantlab.Int8SymmetricConfig, (36.079, rtn), quick=True),
        Variant("int8 (per channel) gptq", "quantlab", lambda: quantlab.Int8SymmetricConfig(solver="gptq"), quick=True),
        Variant("nf4 b64 + double quant", "quantlab", quantlab.NF4Config, (45.610, "bnb NF4+DQ"), quick=True),
        Variant("nf4 b64", "quantlab", lambda: quantlab.NF4Config(double_quant=False), (45.673, "bnb NF4")),
        Variant("nf4 b64 + double quant mse", "quantlab", lambda: quantlab.NF4Config(solver="mse"), quick=True),
        Variant("nf4 b64 + double quant gptq", "quantlab", lambda: quantlab.NF4Config(solver="gptq"), quick=True),
        Variant(
            "nf4 b64 + double quant gptq self-calibrated",
            "quantlab",
            lambda: quantlab.NF4Config(solver="gptq", self_calibration=True),
            quick=True,
        ),
    ]
    for bits in (8, 4, 3, 2):
        for group in (64, 128):
            for symmetric in (False, True):
                for solver, awq in SOLVERS:
                    variants.append(_custom_bits(bits, group, symmetric, solver, awq))
    # 3-bit g32 symmetric also stores 3.5 bits per weight: a uniform rival of mixed precision at 3.5.
    variants.append(_custom_bits(3, 32, True, "gptq", False))
    variants += lut_variants()
    variants += rotation_variants()
    variants += reconstruct_variants()
    variants += qat_variants()
    variants += minilm_qat_variants()
    variants += embedding_variants()
    for target in (4.25, 3.5, 3.25, 3.0, 2.5):
        variants.append(
            Variant(
                f"mixed {target} bits/weight gptq",
                "quantlab",
                lambda target=target: quantlab.CustomBitsConfig(
                    bits=3, group_size=64, solver="gptq", target_bits=target
                ),
                quick=target in (4.25, 3.5, 3.25),
            )
        )
    return variants


def lut_variants() -> list[Variant]:
    """Learned per-layer tables (`lut`) in groups of 64 with float16 scales: the bits of symmetric integers
    at the same group size plus the table, round to nearest (the table fitted to the weight alone) and GPTQ
    (fitted with each input channel weighted by its calibration E[x^2])."""
    return [
        Variant(
            f"lut {bits}-bit g64 {solver}",
            "quantlab",
            lambda bits=bits, solver=solver: quantlab.LutConfig(bits=bits, group_size=64, solver=solver),
            quick=solver == "gptq",
        )
        for bits in (4, 3, 2)
        for solver in ("rtn", "gptq")
    ]


# The MLP's output projection of each model: SmolLM2's down projections, MiniLM's `encoder.layer.N.output.dense`
# (not the attention's `...attention.output.dense`): the online Hadamard rotation of SpinQuant's R4.
MLP_OUTPUT_LAYERS = ["down_proj", r"encoder\.layer\.\d+\.output\.dense"]


def rotation_variants() -> list[Variant]:
    """Symmetric integers in groups of 64 with the MLP output projections' inputs rotated by a Hadamard matrix
    (`rotate_inputs`), round to nearest and GPTQ at 4, 3 and 2 bits: each beside its unrotated row."""
    return [
        Variant(
            f"custom_bits {bits}-bit g64 sym {solver}, mlp output rotated",
            "quantlab",
            lambda bits=bits, solver=solver: quantlab.CustomBitsConfig(
                bits=bits, group_size=64, symmetric=True, solver=solver, rotate_inputs=MLP_OUTPUT_LAYERS
            ),
            quick=solver == "gptq" and bits == 3,
        )
        for bits in (4, 3, 2)
        for solver in ("rtn", "gptq")
    ]


# Block-wise reconstruction (about 30 minutes a row on 2 cores): the settings of the acceptance targets.
RECONSTRUCT_ROWS = ((4, 64, True), (3, 64, True), (3, 128, False), (3, 64, False), (2, 64, True), (2, 128, False))


def reconstruct_variants() -> list[Variant]:
    """The `reconstruct` solver (GPTQ, then each block trained on its outputs) at 4, 3 and 2 bits, and
    mixed precision at 3.25 bits per weight under it; each has a GPTQ row with the same storage to compare."""
    variants = [_custom_bits(bits, group, sym, "reconstruct", False) for bits, group, sym in RECONSTRUCT_ROWS]
    variants.append(
        Variant(
            "mixed 3.25 bits/weight reconstruct",
            "quantlab",
            lambda: quantlab.CustomBitsConfig(bits=3, group_size=64, solver="reconstruct", target_bits=3.25),
        )
    )
    variants.append(Variant("lut 3-bit g64 reconstruct (one down_proj g128)", "quantlab", lut_3bit_reconstruct))
    return variants


# A learned 3-bit table costs 8 x 16 bits a layer beside the 3.25 bits per weight of 3-bit codes with a float16
# scale per 64: 26,880 bits for SmolLM2's 210 layers. One down_proj (1536 inputs) in groups of 128 stores
# 110,592 bits less, so the file stays within 3.25 bits per weight (3.2492).
LUT_3BIT_LAYER_OPTIONS = {"model.layers.15.mlp.down_proj": {"group_size": 128}}


def lut_3bit_reconstruct() -> Any:
    """Learned 3-bit tables in groups of 64 under block-wise reconstruction, within 3.25 bits per weight."""
    return quantlab.LutConfig(bits=3, group_size=64, solver="reconstruct", layer_options=LUT_3BIT_LAYER_OPTIONS)


def lut_budget_reconstruct(bits: int, rotation: str | None = None) -> Any:
    """Learned tables under block-wise reconstruction within `bits + 0.25` bits per weight, each layer's width
    and group size chosen by mixed precision (`target_bits`) instead of a layer named by hand; `rotation` as in
    LUT_BUDGET_QAT_ROWS."""
    rotate, blocks, _ = LUT_ROTATIONS[rotation]
    return quantlab.LutConfig(
        bits=bits,
        group_size=64,
        solver="reconstruct",
        target_bits=bits + 0.25,
        rotate_inputs=rotate,
        rotation_blocks=blocks,
    )


# Quantization-aware training (`quantlab qat` defaults: lr 5e-3 in grid steps, cosine, KL from the float
# model) on the bundled text after the evaluation windows. From GPTQ's codes, 100 steps of 4 x 256 tokens
# (about 16 minutes a row on 2 quiet cores): bits, group size, steps, GPTQ's calibration windows, whether the MLP
# output projections' inputs are rotated (`rotate_inputs`).
QAT_ROWS = (
    (4, 64, 100, 128, False),
    (3, 64, 100, 128, False),
    (2, 64, 100, 128, False),
    (4, 64, 100, 128, True),
    (3, 64, 100, 128, True),
)
QAT_TRAINING = {"learning_rate": 5e-3, "per_device_train_batch_size": 4, "lr_scheduler_type": "cosine",
                "warmup_steps": 0.05, "seed": 0, "logging_steps": 5}  # fmt: skip
# From the reconstruction's codes with the normalization layers training at 0.02 x the rate, the runs of the
# 3- and 2-bit targets (about an hour a row on 2 quiet cores): bits, group size, steps, tokens per example,
# examples per step.
RECONSTRUCT_QAT_ROWS = ((3, 64, 400, 512, 2), (2, 64, 400, 256, 4))
# Texts of the evaluated file away from both evaluated parts (`training_text_file`; described below).
LONGER_TEXT = "before the later part"
OUTSIDE_TEXT = "outside both evaluated parts"
TRAINING_TEXTS = (LONGER_TEXT, OUTSIDE_TEXT)
# The same with every projection's input rotated, trained 4 x 256 tokens a step on one of TRAINING_TEXTS (above):
# bits, group size, steps, rotation blocks ("largest": whole rows; "power_of_two": the default), the bits per
# weight mixed precision chooses widths and groups within (None: every layer at `bits` and `group`), the training
# text, the steps of a second run on the result at half the rate with another data order (0: none), and whether
# the float embedding table (tied to the head) trains too, at the norms' rate (`--embedding-lr-ratio`).
ROTATED_RECONSTRUCT_QAT_ROWS = (
    (2, 64, 300, "largest", None, LONGER_TEXT, 0, False),
    (2, 64, 400, "power_of_two", None, LONGER_TEXT, 0, False),
    (2, 64, 500, "power_of_two", 2.25, LONGER_TEXT, 0, False),
    (2, 64, 400, "power_of_two", 2.25, OUTSIDE_TEXT, 0, False),
    (2, 64, 400, "power_of_two", 2.25, OUTSIDE_TEXT, 400, False),
)
# From the learned 3-bit tables' reconstruction (`lut_3bit_reconstruct`): steps, tokens per example, examples per step.
LUT_QAT_ROWS = ((100, 256, 4),)
# From learned tables whose widths and group sizes mixed precision chose (`lut_budget_reconstruct`): bits, steps,
# which inputs are rotated (None; "mlp output": the down projections in power-of-two blocks; "every projection":
# all seven in whole rows; EVERY_PROJECTION_BLOCKS: all seven in power-of-two blocks), the training text
# ("bundled": the bundled text after the evaluation windows; "before the later part": the evaluated text's lines
# before token LATER_PART_OFFSET - TRAINING_MARGIN, about 190,000 tokens after the evaluation windows, twice the
# bundled text's; "outside both evaluated parts": those and the lines from TRAINING_MARGIN tokens after the later
# part's windows to the end, about 283,000 tokens on the shared text), and whether the float embedding table (tied
# to the head) trains too, at the norms' rate, under bfloat16 autocast (`--embedding-lr-ratio 0.02 --bf16`).
EVERY_PROJECTION_BLOCKS = "every projection in power-of-two blocks"
LUT_BUDGET_QAT_ROWS = (
    (4, 100, None, "bundled", False),
    (3, 100, None, "bundled", False),
    (3, 100, "mlp output", "bundled", False),
    (3, 100, "every projection", "bundled", False),
    (3, 300, "every projection", LONGER_TEXT, False),
    (3, 400, "every projection", OUTSIDE_TEXT, False),
    (2, 500, EVERY_PROJECTION_BLOCKS, OUTSIDE_TEXT, True),
)
BLOCK_WORDS = {"largest": " in whole rows", "power_of_two": " in power-of-two blocks"}
EVERY_PROJECTION = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Each rotation kind of LUT_BUDGET_QAT_ROWS: the rotated layers, their Hadamard blocks, and the words in the row's name.
LUT_ROTATIONS = {
    None: (None, "power_of_two", ""),
    "mlp output": (MLP_OUTPUT_LAYERS, "power_of_two", ", mlp output rotated"),
    "every projection": (EVERY_PROJECTION, "largest", ", every projection rotated"),
    EVERY_PROJECTION_BLOCKS: (EVERY_PROJECTION, "power_of_two", ", every projection rotated in power-of-two blocks"),
}
TRAINING_MARGIN = 1_000  # tokens between the training texts and the later part's windows, on either side
RECONSTRUCT_QAT_NORM_LR_RATIO = 0.02
# A second run on a trained result (the rows' `again` steps): half the first run's rate, another data order.
AGAIN_TRAINING = {"learning_rate": 2.5e-3, "seed": 1}


def qat_variants() -> list[Variant]:
    """`quantlab qat`: GPTQ's or the reconstruction's codes (symmetric integers, or learned tables), then
    every quantized layer trained through fake quantizers against the float model's KL divergence."""

    def from_gptq(bits: int, group: int, steps: int, samples: int, rotate: bool) -> Callable[[Path, Path | None], Any]:
        start = quantlab.CustomBitsConfig(
            bits=bits,
            group_size=group,
            symmetric=True,
            solver="gptq",
            calibration_samples=samples,
            rotate_inputs=MLP_OUTPUT_LAYERS if rotate else None,
        )
        return lambda directory, _: qat_model_of(directory, start, steps, 256, 4, None)

    def from_reconstruction(start: Any, steps: int, seq_len: int, batch: int) -> Callable[[Path, Path | None], Any]:
        return lambda directory, _: qat_model_of(directory, start, steps, seq_len, batch, RECONSTRUCT_QAT_NORM_LR_RATIO)

    def on_training_text(
        start: Any, steps: int, again: int = 0, tables: bool = False, bf16: bool = False
    ) -> Callable[[Path, Path | None], Any]:
        def build(directory: Path, training: Path | None) -> Any:
            if training is None:
                raise ValueError("this row trains on the evaluated text outside its windows; none was given")
            table_lr_ratio = RECONSTRUCT_QAT_NORM_LR_RATIO if tables else None
            return qat_model_of(directory, start, steps, 256, 4, RECONSTRUCT_QAT_NORM_LR_RATIO, training, again,
                                table_lr_ratio, bf16)  # fmt: skip

        return build

    def integers(bits: int, group: int, blocks: str | None = None, target_bits: float | None = None) -> Any:
        """Symmetric integers under block-wise reconstruction; every projection's input rotated in `blocks`;
        with `target_bits`, each layer's width and group chosen by mixed precision within that budget."""
        return quantlab.CustomBitsConfig(
            bits=bits,
            group_size=group,
            symmetric=True,
            solver="reconstruct",
            target_bits=target_bits,
            rotate_inputs=EVERY_PROJECTION if blocks else None,
            rotation_blocks=blocks or "power_of_two",
        )

    variants = [
        Variant(f"qat {bits}-bit g{group} sym (gptq start{', mlp output rotated' if rotate else ''}, {steps} steps)",
                "quantlab", None, build=from_gptq(bits, group, steps, samples, rotate))
        for bits, group, steps, samples, rotate in QAT_ROWS
    ]  # fmt: skip
    variants += [
        Variant(f"qat {bits}-bit g{group} sym (reconstruct start, {steps} x {batch} x {seq_len} tokens)",
                "quantlab", None, build=from_reconstruction(integers(bits, group), steps, seq_len, batch))
        for bits, group, steps, seq_len, batch in RECONSTRUCT_QAT_ROWS
    ]  # fmt: skip
    variants += [
        Variant(f"qat {bits}-bit g{group} sym (reconstruct start{f' within {target} bits/weight' if target else ''}, "
                f"every projection rotated{BLOCK_WORDS[blocks]}, {steps}{f' + {again}' if again else ''} x 4 x 256 "
                f"tokens, text {text}{', embedding table trained' if tables else ''})",
                "quantlab", None, build=on_training_text(integers(bits, group, blocks, target), steps, again, tables),
                training_text=text)
        for bits, group, steps, blocks, target, text, again, tables in ROTATED_RECONSTRUCT_QAT_ROWS
    ]  # fmt: skip
    variants += [
        Variant(f"qat lut 3-bit g64 (reconstruct start, {steps} x {batch} x {seq_len} tokens)", "quantlab", None,
                build=from_reconstruction(lut_3bit_reconstruct(), steps, seq_len, batch))
        for steps, seq_len, batch in LUT_QAT_ROWS
    ]  # fmt: skip
    for bits, steps, rotation, text, tables in LUT_BUDGET_QAT_ROWS:
        budget = f"within {bits + 0.25} bits/weight"
        budget += LUT_ROTATIONS[rotation][2]
        own_text = text in TRAINING_TEXTS  # else the bundled text, which `quantlab qat` reads by default
        data = f", text {text}" if own_text else ""
        data += ", embedding table trained, bf16" if tables else ""
        name = f"qat lut {bits}-bit (reconstruct start {budget}, {steps} x 4 x 256 tokens{data})"
        start = lut_budget_reconstruct(bits, rotation)
        build = (
            on_training_text(start, steps, tables=tables, bf16=tables)
            if own_text
            else from_reconstruction(start, steps, 256, 4)
        )
        variants.append(Variant(name, "quantlab", None, build=build, training_text=text if own_text else None))
    return variants


def qat_model_of(
    directory: Path,
    start: Any,
    steps: int,
    seq_len: int,
    batch: int,
    norm_lr_ratio: float | None,
    data: Path | None = None,
    again: int = 0,
    embedding_lr_ratio: float | None = None,
    bf16: bool = False,
) -> torch.nn.Module:
    """`qat_model(directory, config=start)` into a temporary run folder; the trained checkpoint, loaded.

    The same as `quantlab quantize` with `start`'s options (`--method custom_bits --bits B --group-size G
    --symmetric --solver S`, or the learned tables' `--method lut ...`) `-o START`, then `quantlab qat START
    --max-steps N --max-seq-length L --per-device-train-batch-size K [--norm-lr-ratio R] [--embedding-lr-ratio E]
    [--data FILE] [--bf16] -o RUN`
    (`quantlab qat` holds out the first 16 x 512 tokens of FILE, the harness's windows); with `again` steps, then
    `quantlab qat RUN/final --teacher FLOAT --max-steps AGAIN --learning-rate 2.5e-3 --seed 1` with the other
    flags the same."""
    from quantlab.qat import QATOptions
    from quantlab.workflows.qat import qat_model
    from quantlab.workflows.runs import TrainingRun

    training = {**QAT_TRAINING, "max_steps": steps, "per_device_train_batch_size": batch, "bf16": bf16}
    options = QATOptions(norm_lr_ratio=norm_lr_ratio, embedding_lr_ratio=embedding_lr_ratio)
    with tempfile.TemporaryDirectory(prefix="quantlab-quality-qat-") as scratch:

        def run_in(folder: str, settings: dict[str, Any]) -> TrainingRun:
            return TrainingRun(Path(scratch) / folder, settings, max_seq_length=seq_len, eval_windows=16, data=data)

        report = qat_model(directory, run_in("run", training), config=start, options=options)
        if again:
            second = run_in("again", {**training, **AGAIN_TRAINING, "max_steps": again})
            report = qat_model(report.output, second, teacher=directory, options=options)
        return AutoModelForCausalLM.from_pretrained(report.output, dtype=torch.float32, local_files_only=True)


# all-MiniLM-L6-v2 trained after block-wise reconstruction: bits, group size, training steps, whether the MLP output
# projections' inputs are rotated, the training text, the weight of the sentence-embedding term (0: per token
# only), and the steps of a second run on the result at half the rate with another data order (0: none). The float
# model's hidden states are the target; the LayerNorms train at 0.1 x the rate; each line is cut to 256 tokens (as
# the evaluation cuts them). Training text
# "bundled": the bundled text's lines after the first 256; "beyond": every line of the evaluated text after the
# first 256 but the last 256 (the later lines the table also reports), about 3.3 times as many on the shared text.
MINILM_QAT_ROWS = (
    (3, 64, 400, False, "bundled", 0.0, 0),
    (3, 64, 400, True, "beyond", 0.0, 0),
    (3, 64, 1200, True, "beyond", 1.0, 800),
)
MINILM_QAT_TRAINING = {"learning_rate": 5e-3, "per_device_train_batch_size": 16, "lr_scheduler_type": "cosine",
                       "warmup_steps": 0.05, "seed": 0, "logging_steps": 20}  # fmt: skip


def minilm_qat_variants() -> list[Variant]:
    """`quantlab qat` on the encoder: reconstruction's codes, then trained against the float model's last
    hidden states (cosine distance at every token, and of the mean-pooled sentence embeddings where weighted)."""

    def build(row: tuple[int, int, int, bool, str, float, int]) -> Callable[[Path, Path | None], Any]:
        return lambda directory, calibration: minilm_qat_model_of(directory, calibration, *row)

    def name(bits: int, group: int, steps: int, rotate: bool, text: str, embedding_weight: float, again: int) -> str:
        more = (", mlp output rotated" if rotate else "") + (", lines up to the last 256" if text == "beyond" else "")
        more += ", sentence embeddings matched" if embedding_weight else ""
        steps_run = f"{steps} + {again} steps" if again else f"{steps} steps"
        return f"qat {bits}-bit g{group} sym (reconstruct start{more}, {steps_run})"

    return [
        Variant(name(*row), "quantlab", None, build=build(row), model="minilm") for row in MINILM_QAT_ROWS
    ]  # fmt: skip


def minilm_qat_model_of(
    directory: Path,
    calibration: Path | None,
    bits: int,
    group: int,
    steps: int,
    rotate: bool,
    text: str,
    embedding_weight: float = 0.0,
    again: int = 0,
) -> Any:
    """The same as `quantlab quantize MINILM --method custom_bits --bits B --group-size G --symmetric --solver
    reconstruct [--rotate-inputs 'encoder\\.layer\\.\\d+\\.output\\.dense'] -o START`, then `quantlab qat START
    --max-steps N --batch-size 16 --max-seq-length 256 --norm-lr-ratio 0.1 --logging-steps 20 --seed 0 [--data
    LINES] [--embedding-weight W] -o RUN`; with `again` steps, then `quantlab qat RUN/final --teacher MINILM
    --max-steps AGAIN --learning-rate 2.5e-3 --seed 1` with the other flags the same."""
    from quantlab.distill import DistillationConfig
    from quantlab.qat import QATOptions
    from quantlab.workflows.qat import qat_model
    from quantlab.workflows.runs import TrainingRun

    config = quantlab.CustomBitsConfig(bits=bits, group_size=group, symmetric=True, solver="reconstruct",
                                       calibration_text=str(calibration) if calibration else None,
                                       rotate_inputs=MLP_OUTPUT_LAYERS if rotate else None)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="quantlab-quality-qat-") as scratch:
        data = None
        if text == "beyond":
            if calibration is None:
                raise ValueError("training on the lines beyond the bundled text needs the evaluated text's later lines")
            data = Path(scratch) / "lines.txt"
            data.write_text("\n".join(text_lines(read_text(calibration))[:-MINILM_LINES]) + "\n", encoding="utf-8")
        training = {"max_steps": steps, **MINILM_QAT_TRAINING}
        run = TrainingRun(Path(scratch) / "run", training, max_seq_length=256, data=data)
        distillation = DistillationConfig(alpha=1.0, temperature=1.0, embedding_weight=embedding_weight)
        report = qat_model(directory, run, config=config, options=QATOptions(norm_lr_ratio=0.1),
                           distillation=distillation)  # fmt: skip
        if again:
            training = {**training, **AGAIN_TRAINING, "max_steps": again}
            run = TrainingRun(Path(scratch) / "again", training, max_seq_length=256, data=data)
            report = qat_model(report.output, run, teacher=directory, options=QATOptions(norm_lr_ratio=0.1),
                               distillation=distillation)  # fmt: skip
        return AutoModel.from_pretrained(report.output, dtype=torch.float32, local_files_only=True)


def embedding_variants() -> list[Variant]:
    """The embedding table and tied head in 8 bits too (`embedding_bits`): the whole-file size of llama.cpp's files."""

    def gptq(embedding_bits: int) -> Callable[[], Any]:
        return lambda: quantlab.CustomBitsConfig(
            bits=4, group_size=64, symmetric=True, solver="gptq", embedding_bits=embedding_bits
        )

    return [
        Variant("nf4 b64 + double quant, embedding int8", "quantlab", lambda: quantlab.NF4Config(embedding_bits=8)),
        Variant("custom_bits 4-bit g64 sym gptq, embedding int8", "quantlab", gptq(8), quick=True),
        Variant("custom_bits 4-bit g64 sym gptq, embedding 6-bit", "quantlab", gptq(6)),
    ]


SOLVERS = (("rtn", False), ("mse", False), ("gptq", False), ("gptq", True))
QUICK_CUSTOM_BITS = {
    (4, 64, False, "rtn", False),
    (4, 64, True, "gptq", False),
    (3, 64, True, "gptq", False),
    (3, 64, False, "gptq", False),
    (3, 32, True, "gptq", False),
    (3, 64, True, "reconstruct", False),
}


def _custom_bits(bits: int, group: int, symmetric: bool, solver: str, awq: bool) -> Variant:
    kind = "sym" if symmetric else "asym"
    label = "awq + gptq" if awq else solver
    peer = (52.749, "RTN, peer baseline") if (bits, group, symmetric, solver) == (4, 64, False, "rtn") else None
    return Variant(
        f"custom_bits {bits}-bit g{group} {kind} {label}",
        "quantlab",
        lambda: quantlab.CustomBitsConfig(bits=bits, group_size=group, symmetric=symmetric, solver=solver, awq=awq),
        peer,
        quick=(bits, group, symmetric, solver, awq) in QUICK_CUSTOM_BITS,
    )


def plugin_variants() -> tuple[list[Variant], list[str]]:
    """The `hqq` plugin's rows, if it is installed (plugins/quantlab-hqq)."""
    if "hqq" not in quantlab.list_methods():
        return [], ["plugin method 'hqq' is not installed (pip install -e plugins/quantlab-hqq): its rows are skipped"]
    config_class = quantlab.get_method("hqq").config_class
    peers = {(4, 64): 44.479, (4, 128): 49.983, (3, 64): 345.46}
    variants = [
        Variant(
            f"hqq (plugin) {bits}-bit g{group}",
            "plugin",
            lambda bits=bits, group=group: config_class.from_options({"bits": bits, "group_size": group}),
            (peer, "hqq package, peer baseline"),
            quick=(bits, group) == (4, 64),
        )
        for (bits, group), peer in peers.items()
    ]
    return variants, []


def bitsandbytes_variants() -> tuple[list[Variant], list[str]]:
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        return [], ["bitsandbytes is not installed (pip install 'quantlab[compare]'): its rows are skipped"]

    def nf4(double_quant: bool) -> Callable[[], Any]:
        return lambda: BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=torch.float32,
        )

    return [
        Variant("bitsandbytes nf4 + double quant", "bitsandbytes", nf4(True), (45.610, "peer baseline"), quick=True),
        Variant("bitsandbytes nf4", "bitsandbytes", nf4(False), (45.673, "peer baseline")),
        Variant(
            "bitsandbytes LLM.int8",
            "bitsandbytes",
            lambda: BitsAndBytesConfig(load_in_8bit=True),
            (36.822, "peer baseline"),
        ),
    ], []


# -- measuring ----------------------------------------------------------------------------


def load(
    model_class: type, directory: Path, variant: Variant, row: Row, calibration_text: Path | None = None
) -> torch.nn.Module:
    """Load (and quantize, calibrate) one row's model, recording its time and peak resident memory."""
    if variant.build is not None:
        with stopwatch() as timing, peak_resident() as peak:
            model = variant.build(directory, calibration_text)
        row.load_seconds, row.peak_mib = timing["seconds"], peak["mib"]
        return model.eval()
    config = variant.make_config() if variant.make_config else None
    if calibration_text is not None and getattr(config, "needs_calibration", False) and not config.self_calibration:
        config.calibration_text = str(calibration_text)
    with stopwatch() as timing, peak_resident() as peak:
        model = model_class.from_pretrained(
            directory, dtype=torch.float32, quantization_config=config, local_files_only=True
        )
    row.load_seconds, row.peak_mib = timing["seconds"], peak["mib"]
    return model.eval()


@contextlib.contextmanager
def peak_resident(interval: float = 0.05):
    """The process's largest resident memory (MiB) while the block runs, sampled from /proc."""
    result = {"mib": None}
    stop = threading.Event()
    page = 4096

    def sample() -> None:
        peak = 0
        while not stop.is_set():
            with contextlib.suppress(OSError, ValueError, IndexError):
                peak = max(peak, int(Path("/proc/self/statm").read_text().split()[1]) * page)
            stop.wait(interval)
        result["mib"] = peak / 2**20 if peak else None

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()


def measure_storage(model: torch.nn.Module, row: Row, float_directory: Path) -> None:
    """Bits per quantized weight and checkpoint size, from what `save_pretrained` writes."""
    if row.family == "float":
        row.bits_per_weight = 32.0
        row.checkpoint_mb = sum(f.stat().st_size for f in float_directory.glob("*.safetensors")) / 1e6
        return
    with tempfile.TemporaryDirectory(prefix="quantlab-quality-") as directory:
        model.save_pretrained(directory)
        storage = checkpoint_storage(directory, model=model)
    row.bits_per_weight = storage.bits_per_weight
    row.checkpoint_mb = storage.file_bytes / 1e6
    row.extra["quantized_layers"] = len(storage.layers)


def smollm2_row(variant: Variant, tokenizer: Any, text: str, windows: int, training: Path | None = None) -> Row:
    """One SmolLM2 row; a built row (quantization-aware training) gets `training`, its training text's file."""
    directory = smollm2_dir()
    row = Row(variant.name, variant.family)
    if variant.peer and windows == HARNESS_WINDOWS:
        row.peer_perplexity, row.peer_source = variant.peer
    model = load(AutoModelForCausalLM, directory, variant, row, training)  # None unless the row has its own text
    measure_storage(model, row, directory)
    with stopwatch() as timing:
        row.perplexity = perplexity(model, tokenizer, text, seq_len=HARNESS_SEQ_LEN, windows=windows)
    row.eval_seconds = timing["seconds"]
    row.later_perplexity = later_part_perplexity(model, tokenizer, text, windows)
    return row


def training_text_file(tokenizer: Any, text: str, kind: str, windows: int = HARNESS_WINDOWS) -> Path:
    """A file with the training text `kind` names (TRAINING_TEXTS): `text`'s lines that end before token
    LATER_PART_OFFSET - TRAINING_MARGIN, and for OUTSIDE_TEXT also those that start TRAINING_MARGIN tokens after
    the later part's `windows` windows. Neither reaches the later part; `quantlab qat` holds out the first 16 x 512
    tokens (the harness's windows) itself."""
    if kind not in TRAINING_TEXTS:
        raise ValueError(f"training text {kind!r} is not one of {TRAINING_TEXTS}")
    if windows > HARNESS_WINDOWS:
        raise ValueError(
            f"the training rows hold out {HARNESS_WINDOWS} windows; "
            f"measure with --windows <= {HARNESS_WINDOWS} or leave them out with --only"
        )
    encoded = tokenizer(text, return_offsets_mapping=True, return_attention_mask=False, verbose=False)
    offsets = encoded["offset_mapping"]
    limit = LATER_PART_OFFSET - TRAINING_MARGIN
    resume = LATER_PART_OFFSET + windows * HARNESS_SEQ_LEN + TRAINING_MARGIN
    needed = resume if kind == OUTSIDE_TEXT else limit
    if len(offsets) <= needed:
        raise ValueError(f"the text has {len(offsets)} tokens; the training text {kind!r} needs more than {needed}")
    part = text[: text.rfind("\n", 0, offsets[limit][0]) + 1]
    ids = tokenizer(part, return_attention_mask=False, verbose=False)["input_ids"]
    if ids != encoded["input_ids"][: len(ids)]:
        raise ValueError("the text's lines before the later part do not tokenize as a prefix of the whole text")
    if kind == OUTSIDE_TEXT:
        part += text[text.find("\n", offsets[resume][0]) + 1 :]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="quantlab-smollm2-train-", delete=False) as handle:
        handle.write(part)
    return Path(handle.name)


def later_part_perplexity(model: torch.nn.Module, tokenizer: Any, text: str, windows: int) -> float | None:
    """Perplexity on `windows` windows from token LATER_PART_OFFSET (None when the text is shorter)."""
    ids = token_ids(tokenizer, text)[LATER_PART_OFFSET : LATER_PART_OFFSET + windows * HARNESS_SEQ_LEN]
    if len(ids) < windows * HARNESS_SEQ_LEN:
        return None
    losses = window_losses(model, torch.tensor(ids).view(windows, HARNESS_SEQ_LEN))
    return math.exp(sum(losses) / len(losses))


def minilm_row(
    variant: Variant,
    tokenizer: Any,
    lines: tuple[list[str], list[str]],
    references: tuple[torch.Tensor, torch.Tensor] | None,
    calibration: Path,
) -> Row:
    """Mean-pooled embeddings (`quantlab.eval.embeddings`, as sentence-transformers configures the model)
    of the evaluation lines and the later lines, compared with fp32's by cosine."""
    directory = minilm_dir()
    row = Row(variant.name, variant.family)
    model = load(AutoModel, directory, variant, row, calibration_text=calibration)
    measure_storage(model, row, directory)
    with stopwatch() as timing:
        embeddings = tuple(sentence_embeddings(model, tokenizer, part, MINILM_MAX_TOKENS) for part in lines)
    row.eval_seconds = timing["seconds"]
    row.extra["embeddings"] = embeddings
    if references is not None:
        cosine, later = (embedding_cosines(e, r) for e, r in zip(embeddings, references, strict=True))
        row.cosine_mean, row.cosine_min = float(cosine.mean()), float(cosine.min())
        row.later_cosine_mean = float(later.mean())
    return row


def guarded(measure: Callable[[], Row], variant: Variant) -> Row:
    """Run one row; a failing peer tool must not cost the other rows, so its error becomes the row."""
    try:
        return measure()
    except Exception as error:  # reported in the table, logged with its traceback
        logging.getLogger("quality").exception("%s failed", variant.name)
        return Row(variant.name, variant.family, error=f"{type(error).__name__}: {error}".splitlines()[0][:160])
    finally:
        gc.collect()


# -- reports ------------------------------------------------------------------------------


def smollm2_table(rows: list[Row]) -> str:
    reference = next((r.perplexity for r in rows if r.family == "float" and r.perplexity), None)
    body = []
    for r in rows:
        change = None
        if reference and r.perplexity is not None:
            change = f"{100 * (r.perplexity / reference - 1):+.1f} %"
        peer = f"{r.peer_perplexity:.3f} ({r.peer_source})" if r.peer_perplexity else None
        body.append(
            [
                r.name,
                number(r.perplexity, 3) if r.error is None else f"failed: {r.error}",
                change,
                number(r.later_perplexity, 3),
                peer,
                number(r.bits_per_weight, 3),
                number(r.checkpoint_mb, 1),
                number(r.load_seconds, 1),
                number(r.peak_mib, 0),
                number(r.eval_seconds, 0),
            ]
        )
    columns = [
        "SmolLM2-135M",
        "perplexity",
        "vs fp32",
        f"later part (token {LATER_PART_OFFSET:,})",
        "peer perplexity",
        "bits / quantized weight (file)",
        "checkpoint MB",
        "load + quantize s",
        "peak MiB",
        "eval s",
    ]
    return format_table(columns, body)


def minilm_table(rows: list[Row]) -> str:
    body = [
        [
            r.name,
            number(r.cosine_mean, 5) if r.error is None else f"failed: {r.error}",
            number(r.cosine_min, 5),
            number(r.later_cosine_mean, 5),
            number(r.bits_per_weight, 3),
            number(r.checkpoint_mb, 1),
            number(r.load_seconds, 1),
            number(r.peak_mib, 0),
        ]
        for r in rows
    ]
    columns = [
        "all-MiniLM-L6-v2",
        f"mean cosine to fp32 ({MINILM_LINES} lines)",
        "worst cosine",
        f"mean cosine, last {MINILM_LINES} lines",
        "bits / quantized weight (file)",
        "checkpoint MB",
        "load + quantize s",
        "peak MiB",
    ]
    return format_table(columns, body)


def acceptance(rows: list[Row]) -> list[dict[str, Any]]:
    """The calibration targets this benchmark measures on SmolLM2, each with its figure."""
    by_name = {r.name: r for r in rows if r.error is None}
    results = []

    def best(prefix: str | tuple[str, ...], max_bits: float) -> Row | None:
        fitting = [
            r
            for name, r in by_name.items()
            if name.startswith(prefix) and r.bits_per_weight is not None and r.bits_per_weight <= max_bits + 1e-9
        ]
        return min(fitting, key=lambda r: r.perplexity, default=None)

    def check(label: str, row: Row | None, limit: float | None) -> None:
        value = row.perplexity if row else None
        ok = value is not None and (limit is None or value <= limit)
        results.append({"check": label, "row": row.name if row else None, "value": value, "limit": limit, "ok": ok})

    check("4-bit at <= 4.25 bits/weight", best("custom_bits 4-bit", 4.25) or best("nf4", 4.25), 40.85)
    check("3-bit at <= 3.25 bits/weight", best("custom_bits 3-bit", 3.25), 54.1)
    check("mixed precision at <= 3.25 bits/weight", best("mixed 3.25", 3.25), 54.1)
    # The block-wise reconstruction targets: 4 bits below 38, 3 bits below 42, 2 bits within twice fp32.
    check("block-wise: 4-bit at <= 4.25 bits/weight", best("custom_bits 4-bit", 4.25), 38.0)
    check("block-wise: 3-bit at <= 3.25 bits/weight", best("custom_bits 3-bit", 3.25), 42.0)
    check("block-wise: 2-bit at <= 2.25 bits/weight", best("custom_bits 2-bit", 2.25), 72.0)
    check("qat: 4-bit at <= 4.25 bits/weight", best("qat 4-bit", 4.25), 38.0)
    check("qat: 3-bit at <= 3.25 bits/weight", best("qat 3-bit", 3.25), 42.0)
    check("qat: 2-bit at <= 2.25 bits/weight", best("qat 2-bit", 2.25), 72.0)
    # The best recipes' targets, from QAT rows whose budgets name no layer by hand (3 bits: the learned tables
    # whose widths and groups mixed precision chose, and symmetric integers).
    check("best recipe: 4-bit at <= 4.25 bits/weight", best("qat 4-bit", 4.25), 37.3)
    check(
        "best recipe: 3-bit at <= 3.25 bits/weight",
        best(("qat 3-bit", "qat lut 3-bit (reconstruct start within"), 3.25),
        40.0,
    )
    check("best recipe: 2-bit at <= 2.25 bits/weight", best("qat 2-bit", 2.25), 55.0)
    check("int8 gptq", by_name.get("int8 (per channel) gptq"), 36.09)
    nf4_bits = by_name["nf4 b64 + double quant"].bits_per_weight if "nf4 b64 + double quant" in by_name else 4.127
    data_free = [by_name.get(f"nf4 b64 + double quant {solver}") for solver in ("mse", "gptq self-calibrated")]
    fitting = [r for r in data_free if r and r.bits_per_weight is not None and r.bits_per_weight <= nf4_bits + 1e-9]
    best_data_free = min(fitting, key=lambda r: r.perplexity, default=None)
    check("data-free nf4 (mse or self-calibrated) below NF4+DQ at its bits", best_data_free, 45.61)
    mixed = by_name.get("mixed 3.5 bits/weight gptq")
    uniform = best("custom_bits 3-bit", mixed.bits_per_weight if mixed and mixed.bits_per_weight else 3.5)
    check("mixed 3.5 below every uniform 3-bit storing no more", mixed, uniform.perplexity if uniform else None)
    small = [r for r in by_name.values() if r.checkpoint_mb is not None and r.checkpoint_mb <= 100 and r.perplexity]
    best_small = min(small, key=lambda r: r.perplexity, default=None)
    check("whole file <= 100 MB below llama.cpp Q3_K_M (41.66, 93.5 MB)", best_small, 41.66)
    return results


def minilm_acceptance(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """all-MiniLM-L6-v2 at 3 bits (<= 3.25 bits per weight): the best mean cosine to fp32 should reach 0.98."""
    fitting = [
        r
        for r in rows
        if r.get("error") is None
        and r["name"].startswith(("custom_bits 3-bit", "lut 3-bit", "qat 3-bit"))
        and r.get("bits_per_weight") is not None
        and r["bits_per_weight"] <= 3.25 + 1e-9
        and r.get("cosine_mean") is not None
    ]
    row = max(fitting, key=lambda r: r["cosine_mean"], default=None)
    value = row["cosine_mean"] if row else None
    return {"check": "minilm 3-bit at <= 3.25 bits/weight, mean cosine", "row": row["name"] if row else None,
            "value": value, "limit": 0.98, "ok": value is not None and value >= 0.98}  # fmt: skip


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, default=None, help="evaluation text (default: the shared WikiText-2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="a representative subset of the rows")
    parser.add_argument("--models", choices=["smollm2", "minilm", "both"], default="both")
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="TEXT",
        help="only rows whose name contains TEXT, or is TEXT after a leading '=' (repeatable)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the peer baselines used 2)")
    parser.add_argument(
        "--windows",
        type=int,
        default=HARNESS_WINDOWS,
        help=f"perplexity windows (default {HARNESS_WINDOWS}, the harness; other values drop the peer figures)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    text_path = args.text or default_text_path()
    text = read_text(text_path)

    variants = builtin_variants()
    notes: list[str] = []
    for more, more_notes in (plugin_variants(), bitsandbytes_variants()):
        variants += more
        notes += more_notes
    if args.quick:
        variants = [v for v in variants if v.quick]
    if args.only:
        variants = [v for v in variants if v.family == "float" or any(_selects(text, v.name) for text in args.only)]
    for note in notes:
        print(f"note: {note}", flush=True)
    print(f"text: {text_path}; threads: {torch.get_num_threads()}; rows: {len(variants)}", flush=True)

    report: dict[str, Any] = {"environment": environment(), "text": str(text_path), "windows": args.windows}
    report["notes"] = notes
    if args.models in ("smollm2", "both"):
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True)
        rows = []
        smollm2_variants = [v for v in variants if v.model == "smollm2"]
        kinds = sorted({v.training_text for v in smollm2_variants if v.training_text})
        training = {kind: training_text_file(tokenizer, text, kind, args.windows) for kind in kinds}
        try:
            for variant in smollm2_variants:
                data = training.get(variant.training_text)
                rows.append(
                    guarded(lambda v=variant, d=data: smollm2_row(v, tokenizer, text, args.windows, d), variant)
                )
                print(f"  smollm2 {variant.name}: {_summary(rows[-1])}", flush=True)
        finally:
            for path in training.values():
                path.unlink(missing_ok=True)
        print("\n" + smollm2_table(rows) + "\n", flush=True)
        report["smollm2"] = [asdict(r) for r in rows]
        report["acceptance"] = acceptance(rows)
        for check in report["acceptance"]:
            value = "missing" if check["value"] is None else f"{check['value']:.3f}"
            verdict = "ok" if check["ok"] else "NOT MET"
            print(f"acceptance: {check['check']}: {check['row']} {value} <= {check['limit']}: {verdict}")
    if args.models in ("minilm", "both"):
        report["minilm"] = run_minilm(variants, text)
        report["minilm_acceptance"] = check = minilm_acceptance(report["minilm"])
        value = "missing" if check["value"] is None else f"{check['value']:.5f}"
        verdict = "ok" if check["ok"] else "NOT MET"
        print(f"acceptance: {check['check']}: {check['row']} {value} >= {check['limit']}: {verdict}")
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


def _selects(text: str, name: str) -> bool:
    """`--only TEXT`: a row whose name contains TEXT, or is exactly the rest of a TEXT starting with '='."""
    return name == text[1:] if text.startswith("=") else text in name


def run_minilm(variants: list[Variant], text: str) -> list[dict[str, Any]]:
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    all_lines = text_lines(text)
    lines, later_lines = all_lines[:MINILM_LINES], all_lines[-MINILM_LINES:]
    references: tuple[torch.Tensor, torch.Tensor] | None = None
    rows = []
    parts = (lines, later_lines)
    calibration = _text_after(text, lines[-1])
    try:
        for variant in variants:
            if variant.build is not None and variant.model != "minilm":
                continue  # built for SmolLM2 (its quantization-aware training)
            if getattr(variant.make_config and variant.make_config(), "self_calibration", False):
                continue  # an encoder samples no text to calibrate on (quantlab refuses it with that message)
            row = guarded(lambda v=variant, r=references: minilm_row(v, tokenizer, parts, r, calibration), variant)
            embeddings = row.extra.pop("embeddings", None)
            if variant.family == "float" and embeddings is not None:
                references = embeddings
                row.cosine_mean = row.cosine_min = row.later_cosine_mean = 1.0
            rows.append(row)
            print(f"  minilm {variant.name}: {_summary(row)}", flush=True)
    finally:
        calibration.unlink(missing_ok=True)
    print("\n" + minilm_table(rows) + "\n", flush=True)
    return [asdict(r) for r in rows]


def _text_after(text: str, last_line: str) -> Path:
    """A file with the text after MiniLM's evaluation lines: what its calibrated rows calibrate on."""
    start = text.index(last_line) + len(last_line)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="quantlab-minilm-calib-", delete=False) as handle:
        handle.write(text[start:])
    return Path(handle.name)


def _summary(row: Row) -> str:
    if row.error:
        return f"failed: {row.error}"
    metric = f"ppl {row.perplexity:.3f}" if row.perplexity is not None else f"cos {row.cosine_mean}"
    bits = "" if row.bits_per_weight is None or math.isnan(row.bits_per_weight) else f", {row.bits_per_weight:.3f} b/w"
    return f"{metric}{bits}, load {row.load_seconds:.1f} s, eval {row.eval_seconds:.0f} s"


if __name__ == "__main__":
    sys.exit(main())
