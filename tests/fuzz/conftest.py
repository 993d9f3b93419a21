"""Fuzz run report: cases and seconds per decoder, printed at the end of the session."""

from __future__ import annotations

import pytest

from tests.fuzz.harness import CASES, FUZZED, SECONDS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not FUZZED:
        return
    terminalreporter.section("decoder fuzz cases")
    for name in sorted(FUZZED):
        rate = CASES[name] / SECONDS[name] if SECONDS[name] else 0.0
        terminalreporter.write_line(
            f"{name:22s} cases={CASES[name]:>8d} seconds={SECONDS[name]:7.1f} "
            f"cases_per_s={rate:8.0f}"
        )
