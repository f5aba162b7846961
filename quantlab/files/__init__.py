"""Readers of the files users hand quantlab, validated before they allocate or follow anything.

A GGUF file, a safetensors header or a shard index is checked against the file's own length
and against sane limits (counts, string lengths, nesting) before anything is sized from it, and
a path it names must stay inside the model folder. Each failure is one `UnreadableFileError`
naming the file and what is wrong with it.
"""

from quantlab.errors import QuantlabError


class UnreadableFileError(QuantlabError, ValueError):
    """A user's file is damaged, truncated, or names something it must not (a path outside its folder)."""
