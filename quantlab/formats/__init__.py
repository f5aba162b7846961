"""Storage formats: pure functions that turn float weights into codes and back.

Nothing here knows about modules or transformers; each function is tested bit-exactly.
"""
