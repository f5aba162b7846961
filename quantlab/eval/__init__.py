"""Evaluation: the shared perplexity harness and stored size."""

from quantlab.eval.perplexity import perplexity

__all__ = ["perplexity"]
