"""A compiled module's ``.py`` loaded from its source under another name: the pure build's code,
whichever build the module itself runs (the C loops' tests hold the compiled code to it)."""

from __future__ import annotations

import importlib.util
import os


def from_source(module, name: str):
    """``module``'s source file loaded afresh as ``name`` (its ``_COMPILED`` is False)."""
    leaf = module.__name__.rpartition(".")[2]
    path = os.path.join(os.path.dirname(module.__file__), leaf + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    assert not loaded._COMPILED
    return loaded
