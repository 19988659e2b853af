"""The gateway's config, scheduler and timing feed on their own (no server needed: pure asyncio,
YAML and bytes)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import servescope


def test_cli_refuses_a_bad_config_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "gateway.yaml"
    bad.write_text("upstreams: {u: {url: 'ftp://x'}}\nteams: {a: {keys: [k]}}\n")
    result = servescope("gateway", "--config", str(bad), timeout=120)
    assert result.returncode == 2 and "must be an http:// URL" in result.stderr
    result = servescope("gateway", "--config", str(tmp_path / "missing.yaml"), timeout=120)
    assert result.returncode == 2
    good = tmp_path / "ok.yaml"
    good.write_text(
        "upstreams: {u: {url: 'http://127.0.0.1:9', model: m}}\nteams: {a: {keys: [k]}}\n"
    )
    assert servescope("gateway", "--config", str(good), "--check", timeout=120).returncode == 0
