"""Load a tool of the checkout's ``scripts/`` folder (not part of the installed package) as a module.

``load_script("flashinfer_introspect")`` imports ``scripts/flashinfer_introspect.py`` once per
process under the module name ``flashinfer_introspect`` (registered in ``sys.modules``, so its
dataclasses, ``monkeypatch.setattr`` and pickling see one module object).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from pytest_sparse_mla.implementations._source import exec_source

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """The module ``scripts/<name>.py``, imported on first use (``_source.exec_source`` with no
    stubs: registered in ``sys.modules``, removed again if it raises)."""
    return exec_source(name, SCRIPTS / f"{name}.py", {})
