"""Loading a module of ``benches/`` (not a package) by name, for the tests of the bench tools."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parents[1] / "benches"


def load_bench(name: str):
    """``benches/<name>.py`` as module ``name`` (registered in ``sys.modules`` first, so the bench
    modules that import each other by name, as ``node_ablation`` imports ``critical_path``,
    share one copy)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
