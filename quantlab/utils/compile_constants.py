"""`assume_constant_result` without importing torch._dynamo.

`torch.compiler.assume_constant_result(fn)` marks `fn` so that torch.compile calls it once while tracing
and keeps its result as a constant; calling it imports torch._dynamo, over a second of every `import
quantlab`. `constant_result` sets the same mark itself (a test checks it is still the one torch sets).
"""

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

MARK = "_dynamo_marked_constant"  # what torch.compiler.assume_constant_result sets on the function


def constant_result(fn: F) -> F:
    """`fn`, marked as `torch.compiler.assume_constant_result` marks it."""
    setattr(fn, MARK, True)
    return fn
