"""Comparing greedy generations whose caches or kernels round differently (tests of KV caches and decode steps)."""


def assert_same_tokens_but_near_ties(reference, quantized, prompt: str, margin: float = 0.05) -> None:
    """Greedy sequences equal, or first differing where the float cache's two best logits were within
    `margin` of each other (a tie that any rounding, the cache's included, may turn either way)."""
    differ = (reference.sequences != quantized.sequences).nonzero()
    if len(differ):
        step = int(differ[0, 1]) - (reference.sequences.shape[1] - len(reference.logits))
        best = reference.logits[step][0].topk(2).values
        assert float(best[0] - best[1]) < margin, f"{prompt!r}: token {step} differs at a margin of {best[0] - best[1]}"


SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
GREEDY_64 = {
    "max_new_tokens": 64, "min_new_tokens": 64, "do_sample": False, "output_logits": True,
    "return_dict_in_generate": True,
}  # fmt: skip
