"""The conftest guard against CPython 3.11's re-entrant ``ast.parse`` crash (see tests/conftest.py).

Objects whose ``__del__`` raises are collected while ``ast.parse`` builds its tree, and an unraisable hook
formats their tracebacks the way pytest's does. Without the guard this raises ``SystemError: AST
constructor recursion depth mismatch`` within a few parses on 3.11.7; with it every parse succeeds.
"""

from __future__ import annotations

import ast
import gc
import sys
import traceback
from pathlib import Path


class _RaisesWhenCollected:
    def __del__(self):
        [0][0] + {}["missing"]  # a binary operation: the line 3.11 would parse for caret anchors


def _format_like_pytest(unraisable) -> None:
    traceback.format_exception(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)


def test_parsing_survives_tracebacks_formatted_during_garbage_collection():
    source = Path(ast.__file__).read_text() * 2
    old_hook, old_threshold = sys.unraisablehook, gc.get_threshold()
    sys.unraisablehook = _format_like_pytest
    gc.set_threshold(50, 1, 1)
    try:
        for _ in range(10):
            for _ in range(200):  # reference cycles: freed only by the collector, mid-parse
                a, b = _RaisesWhenCollected(), _RaisesWhenCollected()
                a.other, b.other = b, a
                del a, b
            ast.parse(source)
    finally:
        gc.set_threshold(*old_threshold)
        gc.collect()
        sys.unraisablehook = old_hook
