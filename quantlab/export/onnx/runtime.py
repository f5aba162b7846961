"""`OnnxCausalLM`: logits and greedy or sampled generation on an onnxruntime session.

Works with both kinds of causal-LM export: with past key values, each step feeds only the
new token and the cache the previous step returned; without them, each step runs the whole
sequence again (quadratic, but it needs nothing from the model but its logits).
"""

import os
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort
import torch

from quantlab.export.onnx.errors import ExportError

_PAST_PREFIX = "past_key_values."
_PRESENT_PREFIX = "present."
_NUMPY_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class OnnxCausalLM:
    """A causal LM exported by `quantlab.export.to_onnx`, run by onnxruntime.

    `threads`: onnxruntime's intra-op threads (None: onnxruntime's default, one per core).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        threads: int | None = None,
        providers: Sequence[str] = ("CPUExecutionProvider",),
    ) -> None:
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(os.fspath(path), options, providers=list(providers))
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        if not {"input_ids", "attention_mask"} <= set(inputs) or "logits" not in outputs:
            raise ExportError(
                f"{path} is not a causal LM exported by quantlab (inputs {sorted(inputs)}, outputs {outputs}); "
                f"export one with quantlab.export.to_onnx(model, path)"
            )
        self.past_names = [name for name in inputs if name.startswith(_PAST_PREFIX)]
        self.present_names = [_PRESENT_PREFIX + name.removeprefix(_PAST_PREFIX) for name in self.past_names]
        missing = sorted(set(self.present_names) - set(outputs))
        if missing:
            raise ExportError(f"{path} takes past key values but does not return {missing[0]}")
        self._past_layout = {name: inputs[name] for name in self.past_names}

    @property
    def with_past(self) -> bool:
        return bool(self.past_names)

    def forward(self, input_ids, attention_mask=None) -> torch.Tensor:
        """Logits `[batch, sequence, vocab]` of whole sequences (no cache), as a torch tensor."""
        ids = _as_int64(input_ids)
        mask = np.ones_like(ids) if attention_mask is None else _as_int64(attention_mask)
        logits, _ = self._run(ids, mask, self._empty_past(ids.shape[0]))
        return torch.from_numpy(logits)

    __call__ = forward

    def generate(
        self,
        input_ids,
        attention_mask=None,
        *,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Prompt plus up to `max_new_tokens` tokens per row (`[batch, length]`), like `generate`.

        Greedy by default; `do_sample` draws from the softmax of `logits / temperature`,
        restricted to the `top_k` most likely tokens and the smallest set of probability
        `top_p`. Rows that produced `eos_token_id` continue with `pad_token_id` (default: eos).
        Prompts may be left-padded (zeros in `attention_mask`).
        """
        if do_sample and temperature <= 0:
            raise ExportError(f"temperature must be positive when sampling, got {temperature}")
        rng = np.random.default_rng(seed)
        tokens = _as_int64(input_ids)
        mask = np.ones_like(tokens) if attention_mask is None else _as_int64(attention_mask)
        pad = eos_token_id if pad_token_id is None else pad_token_id
        finished = np.zeros(tokens.shape[0], dtype=bool)
        past = self._empty_past(tokens.shape[0])
        step_ids = tokens
        for _ in range(max_new_tokens):
            logits, past = self._run(step_ids, mask, past)
            scores = logits[:, -1, :].astype(np.float32)
            next_tokens = _sample(scores, temperature, top_k, top_p, rng) if do_sample else scores.argmax(-1)
            if eos_token_id is not None:
                next_tokens = np.where(finished, pad, next_tokens)
                finished |= next_tokens == eos_token_id
            tokens = np.concatenate([tokens, next_tokens[:, None]], axis=1)
            mask = np.concatenate([mask, np.ones_like(mask[:, :1])], axis=1)
            step_ids = next_tokens[:, None] if self.with_past else tokens
            if eos_token_id is not None and finished.all():
                break
        return torch.from_numpy(tokens)

    # -- internals --------------------------------------------------------------------------

    def _empty_past(self, batch: int) -> dict[str, np.ndarray]:
        past = {}
        for name, info in self._past_layout.items():
            _, heads, _, head_dim = info.shape
            if not isinstance(heads, int) or not isinstance(head_dim, int):
                raise ExportError(f"{name} has no fixed head count / head size: {info.shape}")
            past[name] = np.zeros((batch, heads, 0, head_dim), dtype=_NUMPY_DTYPES.get(info.type, np.float32))
        return past

    def _run(
        self, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        outputs = self.session.run(["logits", *self.present_names], {"input_ids": ids, "attention_mask": mask, **past})
        return outputs[0], dict(zip(self.past_names, outputs[1:], strict=True))


def _as_int64(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.ascontiguousarray(values, dtype=np.int64)


def _sample(scores: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> np.ndarray:
    scores = scores / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = np.partition(scores, -top_k, axis=-1)[:, -top_k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1)
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # keep a token while the mass before it is below top_p (the most likely one always stays)
        keep_sorted = np.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(-1, keepdims=True)
    return np.array([rng.choice(len(row), p=row) for row in probs], dtype=np.int64)
