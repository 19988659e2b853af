"""Profiles, levers and the command lines the launcher builds."""

from tests.helpers.cli import servescope


def test_dry_run_prints_the_command_line() -> None:
    out = servescope(
        "serve", "--dry-run", "--profile", "no-chunked-prefill", "--port", "8042", check=True
    ).stdout
    assert "--no-enable-chunked-prefill" in out
    assert "--port 8042" in out
    assert "HF_HUB_OFFLINE=1" in out
