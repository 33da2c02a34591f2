"""Every benchmark script still imports: they run by hand, outside the suite, so a renamed name they use would
otherwise go unnoticed until someone measures."""

import importlib
import pathlib

import pytest

FOLDER = pathlib.Path(__file__).parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in FOLDER.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_imports(name):
    importlib.import_module(f"benchmarks.{name}")
