"""Evaluation: the shared perplexity harness, the real models and text, stored size."""

from quantlab.eval.perplexity import perplexity

__all__ = ["perplexity"]
