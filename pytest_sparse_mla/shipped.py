"""Where the sub-packages shipped inside ``pytest_sparse_mla`` live: the suites and the goldens.

The suites (``suites/``) and goldens (``golden/``) of a checkout are installed as the packages
``pytest_sparse_mla.suites`` and ``pytest_sparse_mla.golden`` (``[tool.setuptools.package-dir]`` of
``pyproject.toml``): a wheel holds them under ``pytest_sparse_mla/``, an editable install maps the
checkout's top-level folders there. :func:`package_dir` finds either without importing it.

Public through ``pytest_sparse_mla.api`` (``api.package_dir``, ``api.SUITES_PACKAGE``). Imports
neither pytest nor torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["GOLDEN_PACKAGE", "SUITES_PACKAGE", "package_dir"]

#: The importable package holding the shipped suites: ``pytest -p sparse_mla --pyargs`` it.
SUITES_PACKAGE = "pytest_sparse_mla.suites"
#: The package holding the shipped goldens (``*.tensor.json`` files; no Python code).
GOLDEN_PACKAGE = "pytest_sparse_mla.golden"


def package_dir(name: str) -> Path | None:
    """Where the sub-package ``name`` (``"pytest_sparse_mla.suites"``, ``"pytest_sparse_mla.golden"``)
    lives, as the import system finds it without importing it: ``pytest_sparse_mla/suites`` of a
    wheel, the checkout's top-level ``suites/`` under an editable install (the build maps it there);
    ``None`` when it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return Path(locations[0]).resolve() if locations else None
