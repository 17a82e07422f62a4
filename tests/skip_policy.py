"""No silent skips in CI: with QIR_CI=1 (`make test`) a skip whose reason does not start with a
kind CI may skip (tests/requires.py: "[gpu] ", "[system] ") is reported as a failure, at
collection (a test module that skipped itself) or in a test. Every run's summary counts the
skips by kind."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Generator

import pytest

from tests.requires import ALLOWED_IN_CI


def enforced() -> bool:
    return os.environ.get("QIR_CI") == "1"


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def kind(reason: str) -> str:
    return next((k for k in ALLOWED_IN_CI if reason.startswith(f"[{k}] ")), "here")


def police(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not (enforced() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if kind(reason) == "here":
        report.outcome = "failed"
        report.longrepr = (
            f"QIR_CI=1: skipped, but CI's machine must run it: {reason}\n"
            "Install what it needs, or, if only the GPU machine can run it, say so where the "
            "skip is made (tests/requires.py)."
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    police(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple):
        # a module's own skip (requires.import_or_skip) is reported at the module, not at the
        # helper that raised it
        report.longrepr = (collector.nodeid, None, report.longrepr[2])
    police(report)
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    counts = Counter(kind(skip_reason(r)) for r in skipped)
    words = {"gpu": "need the GPU machine", "system": "a system tool", "here": "other"}
    parts = [f"{counts[k]} {words[k]}" for k in (*ALLOWED_IN_CI, "here") if counts[k]]
    policy = "QIR_CI=1: any other skip fails" if enforced() else "QIR_CI unset"
    terminalreporter.write_line(f"skips by kind: {', '.join(parts)} ({policy})")
