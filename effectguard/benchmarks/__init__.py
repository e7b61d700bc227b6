"""The parts of ``effectguard bench`` (the command itself is :mod:`effectguard.bench`).

* :mod:`~effectguard.benchmarks.processes` — child processes, CPU pinning, ``/proc`` readings
* :mod:`~effectguard.benchmarks.baseline` — the bare pass-through proxy (no ledger)
* :mod:`~effectguard.benchmarks.loadgen` — ``wrk`` or a Python load generator
* :mod:`~effectguard.benchmarks.proxybench` — direct vs baseline vs ``effectguard serve``
* :mod:`~effectguard.benchmarks.transportbench` — the in-process transport vs plain httpx
* :mod:`~effectguard.benchmarks.ledgerbench` — admit+settle pairs per second, group commit
* :mod:`~effectguard.benchmarks.recoverybench` — start-up sweep on a large ledger
* :mod:`~effectguard.benchmarks.report` — the table, the ratios and the targets

Benchmarks print numbers; nothing here asserts a timing.
"""
