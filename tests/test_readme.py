"""Every shell and Python block in the README runs as written, against a real proxy on
the README's port and the fake provider (offline), from a directory that looks like a
fresh checkout with its ``.venv``.

A block preceded by ``<!-- snippet: skip (reason) -->`` is not run here (the quick-start
commands themselves are run by ``.ci/quickstart`` and ``.ci/run``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from effectguard.testing import fake_provider, running_proxy

README = Path(__file__).resolve().parent.parent / "README.md"
README_PORT = 8787
_BLOCK = re.compile(r"(<!-- snippet: skip[^>]*-->\s*\n)?```(sh|python)\n(.*?)```", re.S)

pytestmark = pytest.mark.slow


def snippets() -> list[tuple[str, str]]:
    """The README's runnable blocks, as (language, code), in order."""
    return [(lang, code) for skip, lang, code in _BLOCK.findall(README.read_text()) if not skip]


def test_the_readme_has_runnable_snippets() -> None:
    """The extraction finds the README's shell and Python blocks (the test cannot pass empty)."""
    langs = [lang for lang, _ in snippets()]
    assert langs.count("python") >= 4 and langs.count("sh") >= 1


def test_readme_links_stay_inside_the_repository() -> None:
    """Every relative link in the README points to a file of this repository; none leave it."""
    root = README.parent
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        assert "://" not in target, target
        assert (root / target).resolve().is_relative_to(root), target
        assert (root / target).exists(), target


def test_every_readme_snippet_runs(tmp_path: Path) -> None:
    """Each block exits 0 in a fresh directory, with the proxy of the quick start running."""
    (tmp_path / ".venv").symlink_to(sys.prefix)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for key in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "EFFECTGUARD_LEDGER"):
        env.pop(key, None)
    with (
        fake_provider(tmp_path / "proxy-receipts.jsonl") as upstream,
        running_proxy(
            tmp_path / "effectguard.db",
            port=README_PORT,
            upstreams={"openai": upstream.url, "anthropic": upstream.url},
        ),
    ):
        for i, (lang, code) in enumerate(snippets()):
            command = ["bash", "-euo", "pipefail", "-c", code]
            if lang == "python":
                command = [sys.executable, "-c", code]
            done = subprocess.run(
                command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, (
                f"README block {i} ({lang}) failed:\n{code}\n"
                f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
            )
        assert len(upstream.effects()) >= 3  # curl, openai and anthropic through the proxy
