"""The optional `notify(message)` callback workflows report their steps to."""

from collections.abc import Callable

Notify = Callable[[str], None]

DEFAULT_MODEL_NOTE = "using the embedded SmolLM2-135M-Instruct (converted into the cache on first use)"


def notifier(notify: Notify | None) -> Notify:
    """`notify`, or a callback that drops the message."""
    return notify if notify is not None else _drop


def _drop(message: str) -> None:
    del message
