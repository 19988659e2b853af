"""`--slo` is read by one parser (wire/slo.py) for every command: the same names, the same
messages, and argparse's usage error (exit 2) rather than a traceback."""

from __future__ import annotations

import argparse

import pytest

from servescope.commands.common import add_slo_option
from servescope.wire.slo import SLO_METRICS, BadSlo, parse_slo


def test_bounds_parse_to_milliseconds() -> None:
    assert parse_slo(" ttft_ms=500, tpot_ms=50,,e2e_ms=2e3 ") == {
        "ttft_ms": 500.0,
        "tpot_ms": 50.0,
        "e2e_ms": 2000.0,
    }
    assert parse_slo(None) == parse_slo("") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ttft=5", "unknown SLO metric 'ttft'; use " + ", ".join(SLO_METRICS)),
        ("tpot_ms=fast", "SLO tpot_ms needs a number of milliseconds, got 'fast'"),
    ],
)
def test_a_bad_bound_is_named(text: str, message: str) -> None:
    with pytest.raises(BadSlo, match=message):
        parse_slo(text)


def test_every_command_reads_slo_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="x")
    add_slo_option(parser, "ttft_ms=…", "bounds")
    assert parser.parse_args([]).slo == {}
    assert parser.parse_args(["--slo", "ttft_ms=5"]).slo == {"ttft_ms": 5.0}
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--slo", "queue_ms=5"])
    assert exit_.value.code == 2
    assert "unknown SLO metric 'queue_ms'" in capsys.readouterr().err
