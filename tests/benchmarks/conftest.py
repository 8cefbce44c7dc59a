"""The benchmark scripts (``benchmarks/``) importable by name, as they import each other."""

from __future__ import annotations

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
