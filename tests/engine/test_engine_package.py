"""`from loadplan.engine import load_model`: the entry point at the package, torch loaded on use."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_load_model_is_the_loaders():
    from loadplan.engine import load_model
    from loadplan.engine.loader import load_model as loaders

    assert load_model is loaders


def test_importing_the_package_does_not_import_torch():
    code = "import sys, loadplan.engine; assert 'torch' not in sys.modules; loadplan.engine.load_model; " \
           "assert 'torch' in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_unknown_names_are_attribute_errors():
    import loadplan.engine

    with pytest.raises(AttributeError, match="no attribute 'lod_model'"):
        loadplan.engine.lod_model
