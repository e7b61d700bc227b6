"""The parts of ``effectguard bench`` (the command itself is :mod:`effectguard_bench.cli`).

* :mod:`~effectguard_bench.processes` — child processes, CPU pinning, ``/proc`` readings
* :mod:`~effectguard_bench.baseline` — the bare pass-through proxy (no ledger)
* :mod:`~effectguard_bench.loadgen` — ``wrk`` or a Python load generator
* :mod:`~effectguard_bench.proxybench` — direct vs baseline vs ``effectguard serve``
* :mod:`~effectguard_bench.transportbench` — the in-process transport vs plain httpx
* :mod:`~effectguard_bench.ledgerbench` — admit+settle pairs per second, group commit
* :mod:`~effectguard_bench.recoverybench` — start-up sweep on a large ledger
* :mod:`~effectguard_bench.report` — the table, the ratios and the targets

Benchmarks print numbers; nothing here asserts a timing.
"""
