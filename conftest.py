"""Root conftest of the pytest-sparse-mla checkout.

It only enables ``pytester`` for the plugin's self-tests in ``tests/``. The plugin itself is loaded by
``-p sparse_mla`` (or its ``pytest11`` entry point), never from here: registering one plugin under two
names fails (pytest PR #13253 discussion). Settings the suites need wherever they run (the
Hypothesis profile) live in ``suites/conftest.py``, which ships with the installed suites.
"""

pytest_plugins = ["pytester"]
