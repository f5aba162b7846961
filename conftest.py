"""Shared pytest set-up: refuse a Python without torch (naming the environment to use); offline, quiet transformers."""

import importlib.util
import os

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.exit(
        "this Python has no torch: run the tests in quantlab's environment, `bash .ci/run` "
        "(it creates .venv and installs everything), or `.venv/bin/python -m pytest tests` once it exists",
        returncode=4,
    )

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
