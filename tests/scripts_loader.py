"""Load a tool of the checkout's ``scripts/`` folder (not part of the installed package) as a module.

``load_script("flashinfer_introspect")`` imports ``scripts/flashinfer_introspect.py`` once per
process under the module name ``flashinfer_introspect`` (registered in ``sys.modules``, so its
dataclasses, ``monkeypatch.setattr`` and pickling see one module object).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """The module ``scripts/<name>.py``, imported on first use."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"scripts/{name}.py not found"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
