"""Loaded by the Python processes the tests start (tests/conftest.py puts this folder on their
PYTHONPATH): they see no torch. transformers (which mlx-lm imports) imports torch whenever it
is installed, and torch is here only for the heads' reference code in the pytest process
(tests/reference); specmlx never uses it. Without this each `specmlx` a test starts took
about 1.4 s longer to import, a two-rank test twice as long."""

import sys

sys.modules.setdefault("torch", None)  # importlib.util.find_spec("torch") is then None
