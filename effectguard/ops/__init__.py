"""Operator tools: the ``effectguard`` command line, ``verify`` and automatic
reconciliation through providers' lookup paths."""
