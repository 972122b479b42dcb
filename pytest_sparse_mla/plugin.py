"""The hooks module of pytest-sparse-mla: every pytest hook the plugin implements, and only hooks.

Entry point ``pytest11: sparse_mla``; load it with ``-p sparse_mla``. Each hook is a few lines
that delegate to a logic module (the shape of pytest-xdist's ``src/xdist/plugin.py`` over its
``newhooks.py``, or syrupy's ``src/syrupy/__init__.py`` over its session object):

=================================  ===========================================================
logic module                       what the hooks ask it
=================================  ===========================================================
``options``                        register and parse every option and ini key; activation
``capabilities``                   the machine probe (pytest-free)
``xdist_gpu``                      one GPU and a CPU-thread share per xdist worker; the run report
``selection``                      capability markers -> skips; ``--sparse-mla-xfail-file`` /
                                   ``--sparse-mla-skip-file``
``implementations``                resolve ``--sparse-mla-impl``; ``sparse_mla_needs`` -> skips
``snapshot.session``               the ``--snapshot-update`` guard and the session's golden root
``entry_points``                   implementations declared by installed packages
``dispatch.report``                ``--sparse-mla-deployment-report`` (print, then exit)
``recording``, ``repro``           ``--sparse-mla-repro-dir``: record each test's calls; write
                                   the reproducers of a failed or xfailed test
``run_report``                     whether reports carry their ids; the JSON/Markdown reports
``fixtures``                       the fixtures (registered as a plugin module; no hooks); the
                                   hint for one asked for in a session that does not use the plugin
=================================  ===========================================================

Opt-in. Installing the package makes the options known to pytest and nothing else: until the
session *uses* the plugin (``options.activation``: ``-p sparse_mla``, any ``--sparse-mla-*``
option, any ``sparse_mla_*`` ini key), every hook returns at once, so a foreign project's markers,
header, environment (``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``, ``TRITON_INTERPRET``) and
fixtures are exactly what they are without the package. ``-p no:sparse_mla`` keeps it unloaded.

Nothing here imports torch, triton or flashinfer, or touches CUDA, at import time.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import pytest

from pytest_sparse_mla import capabilities, options

#: Modules registered as plugins when the plugin is active: fixtures only (no hooks).
FIXTURE_MODULES = ("pytest_sparse_mla.fixtures",)
#: Why a session that collects the shipped suites without using the plugin stops.
NEEDS_PLUGIN = (
    "the pytest-sparse-mla suites need the plugin, which is opt-in: run with -p sparse_mla (or add it to addopts)"
)
_NEEDS_PLUGIN_KEY = pytest.StashKey[bool]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Add the hooks downstream projects implement (``pytest_sparse_mla.hookspecs``)."""
    from pytest_sparse_mla import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register every ``--sparse-mla-*`` option and ``sparse_mla_*`` ini key (``options``)."""
    options.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """``--sparse-mla-deployment-report text|json``: print the report alone on stdout and exit 0,
    like ``--markers`` (no header, no collection)."""
    request = options.deployment_report_request(config)
    if request is None:
        return None
    from pytest_sparse_mla.dispatch import report

    fmt, grid = request
    sys.stdout.write(report.render(fmt, report.releases_with(grid)) + "\n")
    sys.stdout.flush()
    return 0


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """When the session uses the plugin: parse the options, pin an xdist worker to its GPU (before
    anything can initialise CUDA), register markers and fixtures, resolve the implementation."""
    reason = options.activation(config)
    if reason is None:
        if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
            from pytest_sparse_mla import selection

            if selection.names_shipped_suites(config):  # say it once, before xdist starts workers
                raise pytest.UsageError(NEEDS_PLUGIN + options.unknown_ini_key_hint(config))
        return
    from pytest_sparse_mla import implementations, xdist_gpu
    from pytest_sparse_mla.snapshot import session as snapshot_session

    opts = options.from_config(config, reason)
    config.stash[options.OPTIONS_KEY] = opts
    if opts.device == "cuda" and getattr(config, "workerinput", None) is None and not config.option.help:
        caps = capabilities.probe()  # asked for CUDA explicitly: say so once, not as a skip per test
        if not caps.cuda_available:
            raise pytest.UsageError(
                f"--sparse-mla-device=cuda: torch sees no CUDA device ({caps.summary()}); "
                "use --sparse-mla-device=auto or cpu"
            )
    xdist_gpu.configure_worker(config)
    for line in options.marker_lines():
        config.addinivalue_line("markers", line)
    if opts.device == "cpu":
        # Triton decides at decoration time whether a kernel is interpreted; set it before any
        # kernel module is imported (triton-lang/triton docs/programming-guide/chapter-3/debugging.rst).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if config.option.reportchars == "fE":  # pytest's default: show why the suites skipped
        config.option.reportchars = "fEs"
    snapshot_session.configure(config)
    for name in FIXTURE_MODULES:
        module = importlib.import_module(name)
        if not config.pluginmanager.is_registered(module):
            config.pluginmanager.register(module, f"sparse_mla:{name.rsplit('.', 1)[-1]}")
    implementations.configure(config)
    if getattr(config, "workerinput", None) is None:  # the controller gathers the coverage table
        config.pluginmanager.register(_ControllerHooks(config), "sparse_mla:controller")
        config.pluginmanager.register(_DeviceFaultHooks(config), "sparse_mla:device-faults")


class _ControllerHooks:
    """Hooks that need the session's config but receive none (registered by ``pytest_configure``
    on the controller, or in a run without xdist)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.session: pytest.Session | None = None
        self.result_form: str | None = None  # the first ResultFormError's message

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session
        from pytest_sparse_mla import run_report

        if run_report.wanted(self.config):
            run_report.start(self.config)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Count the report in the error-class coverage table (``coverage``; xdist carries the
        workers' ``user_properties``). A failure that is a result of the wrong form
        (``guard.ResultFormError``) stops the run: every test would fail alike, so the run ends
        with one usage error (:meth:`pytest_sessionfinish`)."""
        from pytest_sparse_mla import coverage, guard

        coverage.get(self.config).add(report)
        opts = options.get_options(self.config)
        if opts.xfail_draft is not None:
            from pytest_sparse_mla import xfail_draft

            xfail_draft.get(self.config).add(report)
        from pytest_sparse_mla import run_report

        if run_report.wanted(self.config):
            run_report.add(self.config, report)
        form = dict(report.user_properties).get(guard.RESULT_FORM_KEY)
        if form is not None and self.result_form is None:
            self.result_form = str(form)
            reason = guard.RESULT_FORM_STOP
            dsession = self.config.pluginmanager.getplugin("dsession")  # pytest-xdist's controller
            if dsession is not None:
                dsession.shouldstop = reason
            elif self.session is not None:
                self.session.shouldstop = reason

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> Any:
        """A run stopped by a result of the wrong form exits with pytest's usage-error status
        (outermost, so after syrupy's and the other exit-status adjustments). With
        ``--sparse-mla-xfail-draft``, the draft xfail file is written (``xfail_draft``)."""
        result = yield
        if self.result_form is not None:
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
        opts = options.get_options(self.config)
        if opts.xfail_draft is not None:
            from pytest_sparse_mla import xfail_draft

            xfail_draft.write(self.config, opts.xfail_draft, opts.impl)
        return result

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """The result-form usage error, once."""
        if self.result_form is not None:
            terminalreporter.section("sparse-mla usage error", sep="=", red=True, bold=True)
            terminalreporter.write_line(f"ERROR: {self.result_form}")
            terminalreporter.write_line("(the run stopped at the first such result: every test would fail alike)")


class _DeviceFaultHooks:
    """Controller (or a run without xdist): the tests that left the CUDA context dead or timed out
    (``device_health``): collected from the reports, xdist's crash report of a worker that ended
    itself made that test's teardown report, a terminal summary section."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from pytest_sparse_mla import device_health

        device_health.controller_start(self.config, session)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from pytest_sparse_mla import device_health

        device_health.observe(self.config, report)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        """pytest-xdist: a worker that ended itself after a dead CUDA context or a timeout."""
        from pytest_sparse_mla import device_health

        device_health.absorb_crash_report(self.config, crashitem, report)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from pytest_sparse_mla import device_health

        lines = device_health.summary_lines(self.config)
        if lines:
            terminalreporter.section("sparse-mla device faults", sep="-", red=True)
            for line in lines:
                terminalreporter.write_line(line)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Forget the session's golden root and stop recording calls (pytester nests sessions in one
    process)."""
    if options.is_active(config):
        from pytest_sparse_mla import recording
        from pytest_sparse_mla.snapshot import session as snapshot_session

        snapshot_session.unconfigure(config)
        recording.enable(False)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    """What ran where: versions, device, compute capability, seed, implementation, grid, the
    machine's search shard group, id files, goldens, and why the plugin is active."""
    if not options.is_active(config):
        return None
    from pytest_sparse_mla import selection, shards
    from pytest_sparse_mla.snapshot import session as snapshot_session

    opts = options.get_options(config)
    caps = capabilities.probe()
    lines = [f"sparse-mla: {caps.summary()}"]
    lines.append(
        f"sparse-mla: device={opts.device} seed={opts.seed} impl={opts.impl} "
        f"grid={'flashinfer==' + opts.grid if opts.grid else 'none'} "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', 'auto (1 without CUDA)')} "
        f"(active: {opts.activated_by})"
    )
    lines += [f"sparse-mla: probe error: {err}" for err in caps.errors]
    lines += shards.header_lines(opts.search_shards, opts.search_shard_group, opts.search_seed)
    lines += selection.header_lines(config)
    lines += snapshot_session.header_lines(config)
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Capability markers and the implementation's missing capabilities become skips; the xfail
    and skip files mark their tests (all before ``-k``/``-m`` deselection). Not active but
    collecting the shipped suites: a usage error saying how to load the plugin."""
    from pytest_sparse_mla import implementations, selection

    if not options.is_active(config):
        suite_items = selection.shipped_suite_items(items)
        if suite_items and getattr(config, "workerinput", None) is None:
            raise pytest.UsageError(f"{suite_items[0].nodeid}: {NEEDS_PLUGIN}{options.unknown_ini_key_hint(config)}")
        for item in suite_items:  # an xdist worker: a usage error there is an internal error
            item.stash[_NEEDS_PLUGIN_KEY] = True
        return

    from pytest_sparse_mla import coverage

    opts = options.get_options(config)
    selection.skip_unmet(items, options.GPU_REQUIRED_MARKER if opts.require_gpu else None)
    selection.apply_files(config, items)
    implementations.skip_unservable(config, items)
    coverage.mark_intended(items)
    from pytest_sparse_mla import device_health

    device_health.apply_timeouts(config, items)  # pytest-timeout's marker, scaled to the case


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """A kernel's :class:`pytest_sparse_mla.Unsupported` raised outside the envelope guard (a page
    split, a direct call) is reported as a skip with its reason."""
    if not options.is_active(item.config):
        return (yield)
    from pytest_sparse_mla.envelope import Unsupported

    try:
        return (yield)
    except Unsupported as exc:
        raise pytest.skip.Exception(f"refused by the implementation: {exc}", _use_item_location=True) from exc


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    """A failure that is a result of the wrong form (``guard.ResultFormError``) stops this process's
    run and is marked for the controller (``_ControllerHooks``). A test after which the CUDA context
    is dead fails saying so, and a pytest-timeout failure names the kernel call that did not return
    (``device_health``). With ``--sparse-mla-repro-dir``: a failed or xfailed test's wrong calls
    become standalone reproducers (``repro``; a failed write is a warning and a report section).
    Not active: a lookup of one of the plugin's fixtures that failed says how to load it."""
    active = options.is_active(item.config)
    if active:
        from pytest_sparse_mla import device_health

        device_health.note_timeout(call)
    report = yield
    if active:
        from pytest_sparse_mla import run_report, selection

        if run_report.report_ids_wanted(item.config):
            setattr(report, selection.REPORT_ID_ATTR, selection.report_id(item))
        device_health.judge_report(item, call, report)
    elif call.excinfo is not None and report.failed:
        from pytest_sparse_mla import fixtures

        fixtures.hint_inactive_fixture(call.excinfo.value, report)
    if call.excinfo is not None and report.failed:
        from pytest_sparse_mla import guard

        if isinstance(call.excinfo.value, guard.ResultFormError):
            report.user_properties.append((guard.RESULT_FORM_KEY, str(call.excinfo.value.msg)))
            report.longrepr = guard.RESULT_FORM_POINTER  # the message itself is said once, in the summary
            item.session.shouldstop = guard.RESULT_FORM_STOP  # this process (an xdist worker too) stops
    if active and options.get_options(item.config).repro_dir is not None:
        from pytest_sparse_mla import repro

        repro.write_for_report(item, report)
    return report


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A search test (one that uses the ``sparse_mla_search`` fixture) runs once per shard
    (``--sparse-mla-search-shards``), ids ``shard0`` ...: xdist spreads the shards, each with its seed.
    With ``--sparse-mla-search-shard-group I/N``, the session's share of a CI matrix's global shards
    (``shards.session_shards``)."""
    if "sparse_mla_search" in metafunc.fixturenames and options.is_active(metafunc.config):
        from pytest_sparse_mla import shards

        opts = options.get_options(metafunc.config)
        indices = shards.session_shards(opts.search_shards, opts.search_shard_group)
        metafunc.parametrize("sparse_mla_search_shard", list(indices), ids=[shards.shard_id(k) for k in indices],
                             indirect=True)  # fmt: skip


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail (not skip) a GPU test that cannot run when ``--sparse-mla-require-gpu`` is given, and a
    shipped suite test collected by an xdist worker of a session that does not use the plugin.
    With ``--sparse-mla-repro-dir``, start recording the test's calls."""
    opts = item.config.stash.get(options.OPTIONS_KEY, None)
    if opts is not None:  # an active session: record this test's calls only with a repro dir
        from pytest_sparse_mla import device_health, recording

        recording.enable(opts.repro_dir is not None)
        recording.begin_test()
        device_health.begin_test()
    if item.stash.get(_NEEDS_PLUGIN_KEY, False):
        pytest.fail(NEEDS_PLUGIN, pytrace=False)
    mark = item.get_closest_marker(options.GPU_REQUIRED_MARKER)
    if mark is not None:  # only an active session adds it
        pytest.fail(f"--sparse-mla-require-gpu: {mark.kwargs['reason']}", pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """An xdist worker whose CUDA context this test killed exits here, its reports sent, so that
    pytest-xdist starts a fresh worker for the rest (``device_health.exit_if_dead``)."""
    if options.is_active(item.config):
        from pytest_sparse_mla import device_health

        device_health.exit_if_dead(item)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's thread method: report the test with the kernel call that did not return
    before pytest-timeout ends the process (``device_health.start_thread_timer``)."""
    if not options.is_active(item.config):
        return None
    from pytest_sparse_mla import device_health

    return device_health.start_thread_timer(item, settings)


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session) -> Any:
    """Worker: send the device it saw to the controller. Controller: write the JSON run report.

    Then, after every other plugin's ``pytest_sessionfinish``: an exit status of 3 made by adding
    syrupy's unused-snapshot status (1) to an interrupted run's (2, e.g. ``-x`` under xdist) is the
    interrupted status again, and an unused-snapshot 1 on top of failed tests stays 1: pytest's 3
    means an internal error, which a stopped run is not."""
    if options.is_active(session.config):
        from pytest_sparse_mla import xdist_gpu

        xdist_gpu.finish(session.config, session)
    result = yield
    if options.is_active(session.config) and int(session.exitstatus) == 3:
        interrupted = bool(session.shouldstop or session.shouldfail)
        session.exitstatus = pytest.ExitCode.INTERRUPTED if interrupted else pytest.ExitCode.TESTS_FAILED
    return result


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Controller: one line per xdist worker saying which GPU it ran on."""
    if not options.is_active(config):
        return
    from pytest_sparse_mla import coverage, xdist_gpu

    session = getattr(terminalreporter, "_session", None)
    stopped = bool(session is not None and (session.shouldstop or session.shouldfail))
    table = coverage.get(config).lines(stopped_early=stopped)
    if table:
        terminalreporter.section(f"sparse-mla error-class coverage ({options.get_options(config).impl})", sep="-")
        for line in table:
            terminalreporter.write_line(line)
    search = coverage.get(config).search_lines()
    if search:
        terminalreporter.section("sparse-mla search: what was drawn", sep="-")
        for line in search:
            terminalreporter.write_line(line)
    lines = xdist_gpu.summary_lines(config)
    if lines:
        terminalreporter.section("sparse-mla devices per worker", sep="-")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist controller: give worker ``gwN`` its GPU (``xdist_gpu.assign``)."""
    if options.is_active(node.config):
        from pytest_sparse_mla import xdist_gpu

        xdist_gpu.configure_node(node.config, node)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist controller: keep the device record a finished worker sent."""
    if options.is_active(node.config):
        from pytest_sparse_mla import xdist_gpu

        xdist_gpu.record_node(node.config, node)


@pytest.hookimpl(trylast=True)
def pytest_sparse_mla_implementations(config: pytest.Config) -> dict[str, Any] | None:
    """The implementations installed packages declare in the ``pytest_sparse_mla.implementations``
    entry-point group, as ``{name: "module:attribute"}`` (imported only when selected). ``trylast``:
    a name from a ``conftest.py`` or another plugin wins over an installed package's."""
    from pytest_sparse_mla import entry_points

    return dict(entry_points.entry_point_specs()) or None
