"""What the wheel ships besides code: the license its metadata names.

Building a wheel here would need the network (build isolation), so the test reads what
setuptools reads: ``pyproject.toml``'s ``license-files`` (PEP 639: they go into the
wheel's ``.dist-info/licenses/``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_license_the_metadata_names_is_shipped() -> None:
    """license = "Apache-2.0" comes with the Apache 2.0 text, listed in license-files."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text
