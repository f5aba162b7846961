"""Whole jobs run from Python: quantize to a checkpoint, evaluate, export, fine-tune, prune, distill.

Each workflow takes plain arguments (paths, config objects, a `TrainingRun`), checks them before
any model is loaded (a `QuantlabError` naming what is wrong), writes its output atomically without
ever touching its inputs, and returns a report: the data the `quantlab` command prints. Workflows
print nothing but optional progress bars (`progress=True`); notes on what they are doing go to an
optional `notify(message)` callback.
"""

from quantlab.workflows.runs import TrainingRun
from quantlab.workflows.text import EvaluationText, evaluation_text

__all__ = ["EvaluationText", "TrainingRun", "evaluation_text"]
