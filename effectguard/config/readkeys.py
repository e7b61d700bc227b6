"""Which keys of a config file were read: a misspelt key (``heartbeet_s``) is refused, not
passed over in silence while its setting keeps its default.

:func:`tracked` wraps a parsed TOML document so that every lookup is recorded, asked-for
names included (``table.get("lease_s", 15)`` records ``lease_s`` whether or not the file
has it). After the settings are built, :func:`unread` lists the keys the file has and
nothing asked for, with the asked-for names of their table to suggest the right one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


class Tracked(Mapping[str, Any]):
    """A TOML table whose lookups are recorded; tables and arrays of tables inside it are
    tracked too."""

    def __init__(self, table: dict[str, Any]) -> None:
        self._table = {k: _wrap(v) for k, v in table.items()}
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.asked.add(key)
        return self._table[key]

    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(key)
        return self._table.get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.asked.add(key)
        return key in self._table

    def __iter__(self) -> Iterator[str]:
        self.asked.update(self._table)  # a table read whole ([budgets]): every key is used
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)


def _wrap(value: Any) -> Any:
    if isinstance(value, dict):
        return Tracked(value)
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [Tracked(v) for v in value]
    return value


def tracked(document: dict[str, Any]) -> Tracked:
    """``document`` with its lookups recorded."""
    return Tracked(document)


def unread(table: Tracked, where: str = "") -> list[tuple[str, list[str]]]:
    """Each key of ``table`` (dotted, nested tables included) that nothing asked for, with
    the names its table was asked for."""
    found: list[tuple[str, list[str]]] = []
    for key, value in table._table.items():
        path = f"{where}{key}"
        if key not in table.asked:
            found.append((path, sorted(table.asked)))
        elif isinstance(value, Tracked):
            found += unread(value, f"{path}.")
        elif isinstance(value, list):
            for i, entry in enumerate(value):
                if isinstance(entry, Tracked):
                    found += unread(entry, f"{path}[{i}].")
    return found
