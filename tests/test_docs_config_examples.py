"""Every TOML block in the docs is a config file ``effectguard serve --config FILE`` starts
with, as written: an operator copies an example and edits it from there.

The example of docs/configuration.md held placeholders (``sha256 = "..."``, a reconcile
hook in a module no one has) that stopped ``serve``, exit 2, before it listened. A block
preceded by ``<!-- snippet: skip (reason) -->`` is not a config file (a provider
declaration, say) and is not started here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from effectguard.testing import running_proxy

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"(<!-- snippet: skip[^>]*-->\s*\n)?```toml\n(.*?)```", re.S)


def config_blocks() -> list[tuple[str, str]]:
    """(where, text) of each TOML block of README.md and docs/ that is no skip."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        blocks = _BLOCK.findall(page.read_text())
        found += [
            (f"{page.name} toml block {i}", text)
            for i, (skip, text) in enumerate(blocks)
            if not skip
        ]
    return found


def test_the_docs_have_config_examples() -> None:
    """The extraction finds configuration.md's example (the test cannot pass empty)."""
    assert any(where.startswith("configuration.md") for where, _ in config_blocks())


@pytest.mark.parametrize(("where", "text"), config_blocks(), ids=lambda v: v[:40])
def test_each_config_example_starts_serve_as_written(tmp_path: Path, where: str, text: str) -> None:
    config = tmp_path / "effectguard.toml"
    config.write_text(text)
    try:
        with running_proxy(tmp_path / "ledger.db", args=["--config", str(config)]) as proxy:
            assert proxy.url  # it listened and answered /healthz
    except RuntimeError as exc:
        raise AssertionError(f"{where} does not start serve:\n{text}\n{exc}") from None
