"""The operator page: unknown calls, a call's evidence and decisions, budgets, spend.

Served by ``effectguard serve`` under ``/_effectguard/`` when an admin key is
configured (``[[admin.keys]]``); without one the proxy does not mount it at all.
"""

from __future__ import annotations

from effectguard.ingress.admin.routes import AdminPage, operator_page

__all__ = ["AdminPage", "operator_page"]
