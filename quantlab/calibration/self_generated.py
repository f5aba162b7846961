"""Self-calibration: calibration windows the float model writes itself, so calibrating needs no data.

Williams, Chrysostomou and Aletras, "Self-calibration for Language Model Quantization and
Pruning" (NAACL 2025, arXiv 2410.17170): text sampled from the model before it is quantized
approximates what it was trained on, and serves GPTQ/AWQ about as well as real text. Each
window starts at the model's BOS token and is sampled (temperature 1, top-k 50) to exactly
`seq_len` tokens; the draw has its own seed, so the same model always gets the same windows
and the caller's random state is left as it was. No text is read, the evaluation text least
of all.
"""

import torch
from torch import nn
from tqdm.auto import tqdm

from quantlab import distributed
from quantlab.calibration.data import CalibrationDataError

GENERATION_BATCH = 32
TEMPERATURE = 1.0
TOP_K = 50
SEED = 0


@torch.no_grad()
def self_generated_windows(
    model: nn.Module, samples: int, seq_len: int, seed: int = SEED, progress: bool = True
) -> torch.Tensor:
    """`[samples, seq_len]` token ids sampled from `model` (a float causal LM), starting at its BOS token.

    Processes calibrating together use rank 0's windows (sampling is not bit-stable across thread counts)."""
    _start_token(model)  # every rank refuses a model that cannot generate
    if distributed.active() and not distributed.is_main():
        return distributed.broadcast_(torch.zeros(samples, seq_len, dtype=torch.long))
    return distributed.broadcast_(_generate(model, samples, seq_len, seed, progress))


def _generate(model: nn.Module, samples: int, seq_len: int, seed: int, progress: bool) -> torch.Tensor:
    from transformers import GenerationConfig

    start = _start_token(model)
    end = _config_value(model, "eos_token_id")
    sampling = GenerationConfig(
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=1.0,
        max_new_tokens=seq_len - 1,
        min_new_tokens=seq_len - 1,  # never stop early: every window is whole
        pad_token_id=start if end is None else end,
        eos_token_id=end,
    )
    was_training = model.training
    model.eval()
    windows = []
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            batches = range(0, samples, GENERATION_BATCH)
            for first in tqdm(batches, desc="self-calibration: generating text", disable=not progress):
                count = min(GENERATION_BATCH, samples - first)
                prompt = torch.full((count, 1), start, dtype=torch.long, device=model.device)
                mask = torch.ones_like(prompt)
                windows.append(model.generate(prompt, attention_mask=mask, generation_config=sampling)[:, :seq_len])
    finally:
        model.train(was_training)
    return torch.cat(windows).cpu()


def _start_token(model: nn.Module) -> int:
    if not callable(getattr(model, "generate", None)) or not getattr(model, "can_generate", lambda: False)():
        raise CalibrationDataError(
            f"self-calibration samples text from the model, and {type(model).__name__} does not generate text; "
            f"pass calibration_text (--calibration-text FILE) instead"
        )
    for name in ("bos_token_id", "eos_token_id"):
        token = _config_value(model, name)
        if token is not None:
            return token
    raise CalibrationDataError(
        "self-calibration starts each window at the model's BOS token, and its config names none "
        "(bos_token_id and eos_token_id are unset); set config.bos_token_id or pass calibration_text"
    )


def _config_value(model: nn.Module, name: str) -> int | None:
    """`name` from the model's generation config, else its config; the first id of a list."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, name, None)
        if isinstance(value, list | tuple):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return None
