"""Operator tools: the ``effectguard`` command line (``cli`` assembles the commands of
``views``, ``changes`` and ``servecmd``; ``demo`` is ``serve --demo``'s offline upstream),
``verify`` and automatic reconciliation through providers' lookup paths."""
