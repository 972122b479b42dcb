"""Papercuts a new user hit, each now a clear message.

* A test of one's own that asks for one of the plugin's fixtures in a session that does not use the
  plugin: pytest's "fixture 'NAME' not found" says how to load it (``fixtures.FIXTURE_NAMES``).
* An implementation whose ``envelope`` is not a :class:`pytest_sparse_mla.Envelope`: one usage error
  (exit 4) while the session configures, not an error per test (``registry.resolve_implementation``).
* ``--help`` names every built-in implementation (``options.BUILTIN_NAMES``, the keys of
  ``registry.BUILTINS``), without importing torch or the registry.
* The "need the plugin" usage error reads the ini file's keys without pytest 9's deprecated
  ``config.inicfg`` (no ``PytestRemovedIn10Warning``).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

# Imported up front: pytester's in-process runs restore sys.modules afterwards, so a torch first
# imported inside one (the report header probes it) would be unloaded and imported again by the next.
import torch  # noqa: F401

from pytest_sparse_mla import options, plugin

HINT = "is a fixture of pytest-sparse-mla, which is inactive in this session: add -p sparse_mla"

OWN_TESTS = """
import pytest


@pytest.fixture
def my_cache(packed_kv_cache_factory):
    return packed_kv_cache_factory()


def test_direct(packed_kv_cache_factory):
    pass


def test_through_a_fixture(my_cache):
    pass


def test_by_name(request):
    request.getfixturevalue("sparse_mla_impl")


def test_someone_elses(not_a_fixture_of_the_plugin):
    pass
"""


def test_a_fixture_of_the_inactive_plugin_says_how_to_load_it(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_own=OWN_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*fixture 'packed_kv_cache_factory' not found",
            f"*packed_kv_cache_factory {HINT} *",
            "*fixture 'packed_kv_cache_factory' not found",
            f"*packed_kv_cache_factory {HINT} *",
            "*fixture 'not_a_fixture_of_the_plugin' not found",
            "*fixture 'sparse_mla_impl' not found",
            f"*sparse_mla_impl {HINT} *",
        ]
    )
    text = result.stdout.str()
    assert text.count(HINT) == 3, text  # not for a fixture of someone else's
    assert not any(line.startswith("sparse-mla") for line in result.stdout.lines)  # still inert
    assert "packed_kv_cache_factory" not in pytester.runpytest("--fixtures", "-p", "no:cacheprovider").stdout.str()


def test_an_active_session_adds_nothing_to_a_missing_fixture(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    pytester.makepyfile("def test_typo(packed_kv_cache_factori):\n    pass\n")
    result = pytester.runpytest("-p", "sparse_mla", "-p", "no:cacheprovider", "--sparse-mla-device", "cpu")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'packed_kv_cache_factori' not found"])
    assert "inactive in this session" not in result.stdout.str()


def test_fixture_names_are_the_fixtures_the_plugin_registers() -> None:
    from _pytest.fixtures import getfixturemarker

    from pytest_sparse_mla import fixtures

    defined = set()
    for attribute, obj in vars(fixtures).items():
        marker = getfixturemarker(obj)
        if marker is not None:
            defined.add(marker.name or attribute)
    assert plugin.FIXTURE_MODULES == ("pytest_sparse_mla.fixtures",)
    assert sorted(fixtures.FIXTURE_NAMES) == sorted(defined)


DICT_ENVELOPE = """
from pytest_sparse_mla.attention import sparse_mla_forward as _forward


class Kernel:
    name = "dict-envelope"
    envelope = {"num_heads": (64,)}

    def sparse_mla_forward(self, *args, **kwargs):
        return _forward(*args, **kwargs)


kernel = Kernel()
"""


def test_an_envelope_that_is_not_an_envelope_is_one_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(mykernel=DICT_ENVELOPE)
    pytester.makepyfile(
        test_uses_it="""
        import pytest

        @pytest.mark.parametrize("i", range(3))
        def test_impl(sparse_mla_impl, i):
            pass
        """
    )
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", "mykernel:kernel", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    result.stderr.fnmatch_lines(
        [
            "ERROR: --sparse-mla-impl='mykernel:kernel': implementation 'dict-envelope': its envelope attribute "
            "is a dict ({'num_heads': (64,)}): expected a pytest_sparse_mla.Envelope *"
        ]
    )
    assert result.stderr.str().count("envelope attribute") == 1
    assert "test_impl" not in result.stdout.str()  # no test ran


def test_help_lists_every_built_in_implementation(pytester: pytest.Pytester) -> None:
    from pytest_sparse_mla.implementations.registry import BUILTINS

    assert options.BUILTIN_NAMES == tuple(BUILTINS)
    pytester._monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens otherwise
    result = pytester.runpytest("--help", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    text = " ".join(result.stdout.str().split())
    assert f"a built-in name ({', '.join(BUILTINS)});" in text, text


def test_registering_the_options_imports_neither_torch_nor_the_registry() -> None:
    code = (
        "import sys, pytest\n"
        "from pytest_sparse_mla import options\n"
        "options.add_options(pytest.Parser())\n"
        "print('torch' in sys.modules, 'pytest_sparse_mla.implementations.registry' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["False", "False"], run.stdout + run.stderr


MISSPELLED = "'sparse_mla_implementation' (did you mean 'sparse_mla_impl'?)"
_REMOVED_IN_10 = getattr(pytest, "PytestRemovedIn10Warning", pytest.PytestDeprecationWarning)


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["collection", "xdist-configure"])
def test_the_need_the_plugin_error_warns_of_no_deprecation(pytester: pytest.Pytester, xdist: tuple[str, ...]) -> None:
    """Both places the "need the plugin" usage error is raised (``pytest_collection_modifyitems``;
    ``pytest_configure`` before xdist starts workers) read the ini keys without a warning."""
    pytester.makeini("[pytest]\nsparse_mla_implementation = mykernel\n")
    warning = f"{_REMOVED_IN_10.__module__}.{_REMOVED_IN_10.__qualname__}"
    args = ("--pyargs", "pytest_sparse_mla.suites.test_formats", "-p", "no:cacheprovider", *xdist)
    for strict in ((), ("-W", f"error::{warning}")):
        result = pytester.runpytest_subprocess(*args, *strict)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:] + result.stderr.str()[-2000:]
        result.stderr.fnmatch_lines([f"*suites need the plugin*; the ini file sets {MISSPELLED}*"])
        output = result.stdout.str() + result.stderr.str()
        assert "RemovedIn10" not in output and "inicfg" not in output, output[-3000:]


INI_FILES = [
    ("pytest.ini", "[pytest]\nsparse_mla_implementation = x\n"),
    ("tox.ini", "[pytest]\nsparse_mla_implementation = x\n"),
    ("setup.cfg", "[tool:pytest]\nsparse_mla_implementation = x\n"),
    ("pyproject.toml", "[tool.pytest.ini_options]\nsparse_mla_implementation = 'x'\n"),
]
if pytest.version_tuple >= (9,):  # native TOML configuration
    INI_FILES += [
        ("pyproject.toml", "[tool.pytest]\nsparse_mla_implementation = 'x'\n"),
        ("pytest.toml", "[pytest]\nsparse_mla_implementation = 'x'\n"),
    ]


@pytest.mark.parametrize(("name", "text"), INI_FILES, ids=[f"{n}-{t.splitlines()[0]}" for n, t in INI_FILES])
def test_a_misspelled_key_is_found_in_every_kind_of_ini_file(pytester: pytest.Pytester, name: str, text: str) -> None:
    (pytester.path / name).write_text(text)
    config = pytester.parseconfig("-o", "sparse_mla_tolerance=tight.row_sigmas=5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hint = options.unknown_ini_key_hint(config)
    assert MISSPELLED in hint, hint
    assert "'sparse_mla_tolerance' (did you mean 'sparse_mla_tolerances'?)" in hint, hint  # -o


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("lse_conventions", "flashmla", "expected a tuple of 'flashinfer'/'flashmla', got a str (a tuple of one is "
         "written with a trailing comma: ('flashmla',))"),
        ("formats", "dsv4", "got a str (a tuple of one is written with a trailing comma: ('dsv4',))"),
        ("num_heads", 64, "expected None or a tuple of positive ints, got a int (a tuple of one is written with a "
         "trailing comma: (64,))"),
        ("page_block_sizes", [64], "expected None or a tuple of positive ints, got a list"),
        ("bitwise_invariance", "padding", "expected a frozenset (or tuple) of ('padding', 'heads', 'batch', "
         "'layout'), got a str"),
        ("notes", "a fact", "expected a tuple of str, got a str"),
    ],
)  # fmt: skip
def test_an_envelope_field_that_takes_a_tuple_says_so(field: str, value: object, says: str) -> None:
    """``Envelope(lse_conventions='flashmla')``: the problem is the missing tuple, and the message says
    so (the field, the value given, what is expected, how a tuple of one is written)."""
    from pytest_sparse_mla import Envelope

    with pytest.raises(ValueError) as info:
        Envelope(**{field: value})
    assert str(info.value).startswith(f"Envelope({field}={value!r}): expected "), str(info.value)
    assert says in str(info.value), str(info.value)


MISSPELT_CLASS = """
from pytest_sparse_mla.attention import sparse_mla_forward as _forward


class MyKernel:
    name = "my-kernel"

    def sparse_mla_forward(self, *args, **kwargs):
        return _forward(*args, **kwargs)
"""


@pytest.mark.parametrize(
    ("spec", "hint"),
    [
        ("mykernel:Mykernel", "did you mean --sparse-mla-impl=mykernel:MyKernel?"),
        ("mykernel:Kernel", "did you mean --sparse-mla-impl=mykernel:MyKernel?"),
        ("mykernel:MyKernel.sparse_mla_fwd", "did you mean --sparse-mla-impl=mykernel:MyKernel.sparse_mla_forward?"),
    ],
)
def test_a_misspelt_attribute_gets_a_did_you_mean(pytester: pytest.Pytester, spec: str, hint: str) -> None:
    """The module part of ``--sparse-mla-impl module:Attribute`` already gets one; the attribute (the
    class name, case ignored, or an implementation of the module) gets one too."""
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(mykernel=MISSPELT_CLASS)
    result = pytester.runpytest("-p", "sparse_mla", "--sparse-mla-impl", spec, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    err = result.stderr.str()
    assert "has no attribute" in err and hint in err, err[-2000:]


def test_the_report_labels_a_kernel_one_way(tmp_path, monkeypatch, capsys) -> None:
    """``--sparse-mla-impl mykernel:MyKernel`` of a kernel named ``my-kernel``: the Markdown report
    calls it ``my-kernel`` everywhere (title, tables, failures, skips), as its skips and failures
    do; ``mykernel:MyKernel`` appears only in the command; the machine line says ``CUDA build none``
    as the skips do, never ``CUDA None``. The JSON report records both (``implementation``)."""
    import json
    from pathlib import Path

    import inner_session

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "mykernel.py").write_text(MISSPELT_CLASS)
    md, report = tmp_path / "run.md", tmp_path / "run.json"
    args = ["-p", "sparse_mla", str(root / "suites" / "test_attention_accuracy.py"), "-k", "fi-decode-h8-k1024",
            "--sparse-mla-impl", "mykernel:MyKernel", "--sparse-mla-device", "cpu", "-p", "no:cacheprovider",
            "-p", "no:xdist", "-q", "--basetemp", str(tmp_path / "b"), "--sparse-mla-report-md", str(md),
            "--sparse-mla-report-json", str(report)]  # fmt: skip
    code, out = inner_session.run(args, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys, syspath=[tmp_path])
    assert code == 0, out[-2000:]
    page = md.read_text()
    assert page.startswith("# Conformance of my-kernel\n") and "| `my-kernel` |" in page, page[:1500]
    command = next(line for line in page.splitlines() if line.startswith("Command: "))
    assert page.count("mykernel:MyKernel") == command.count("mykernel:MyKernel"), page[:1500]  # the command only
    assert "CUDA None" not in page and ("CUDA build none" in page or "CUDA build 1" in page), page[:600]
    assert json.loads(report.read_text())["implementation"] == {"name": "my-kernel", "spec": "mykernel:MyKernel"}
