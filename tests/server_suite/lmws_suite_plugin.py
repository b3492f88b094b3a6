"""A pytest plugin loaded into llama.cpp's server suite by run.py (``-p lmws_suite_plugin``).

It changes nothing in the suite's files; at run time it
* makes ``ServerPreset.load_all`` (the session's model downloads) a no-op and ``download_file``
  return a stand-in: the suite's ``llama-server`` is our shim, which needs no downloads;
* marks each test listed in expected_failures.txt as an expected failure, with its reason;
* fails a test that runs longer than LMWS_SUITE_TEST_TIMEOUT seconds (a hang stalls nothing);
* writes every test's outcome to LMWS_SUITE_REPORT (JSON) for run.py's count (``deselected``
  for the slow tests run.py leaves out), after each test, so a run cut short still counts;
* makes SIGINT and SIGTERM interrupt the session (a background job inherits SIGINT ignored), so
  the suite's teardown stops its servers.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from expected import load_expected, match  # noqa: E402

_outcomes: dict = {}
_expected = load_expected(HERE / "expected_failures.txt")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _write_report() -> None:
    path = os.environ.get("LMWS_SUITE_REPORT")
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(_outcomes, indent=1, sort_keys=True))
        os.replace(tmp, path)


def pytest_configure(config):
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    utils = sys.modules.get("utils")
    if utils is None:  # the suite's conftest imports it first; without it there is nothing to do
        return
    utils.ServerPreset.load_all = staticmethod(lambda: None)

    def download_file(url, output_file_path=None):
        # the suite's only download is test_speculative's draft model: the MTP stand-in drafts
        # with its own head, so the file is only a name passed to --model-draft (dropped)
        return os.path.join(os.environ["LMWS_SUITE_MODELS"], "tiny-mtp.gguf")

    utils.download_file = download_file


def pytest_collection_modifyitems(config, items):
    for item in items:
        entry = match(_expected, item.nodeid)
        if entry is not None:
            item.add_marker(pytest.mark.xfail(reason=f"{entry.category}: {entry.reason}", strict=False))


class _TestTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _TestTimeout(f"the test ran past LMWS_SUITE_TEST_TIMEOUT ({os.environ.get('LMWS_SUITE_TEST_TIMEOUT')} s)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = int(os.environ.get("LMWS_SUITE_TEST_TIMEOUT", "0") or 0)
    if limit > 0:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(limit)
    try:
        yield
    finally:
        if limit > 0:
            signal.alarm(0)


def pytest_deselected(items):
    # run.py passes -m "not slow", as llama.cpp's tests.sh does: the slow tests download real
    # models (1B to 70B) and assert their text
    for item in items:
        _outcomes[item.nodeid] = "deselected"


def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    prev = _outcomes.get(nodeid)
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed") \
            or (report.when == "teardown" and report.outcome == "failed"):
        if hasattr(report, "wasxfail"):
            outcome = "xpassed" if report.outcome == "passed" else "xfailed"
        else:
            outcome = report.outcome
        if prev is None or prev == "passed":
            _outcomes[nodeid] = outcome
    if report.when == "teardown":
        _write_report()


def pytest_sessionfinish(session, exitstatus):
    _write_report()
