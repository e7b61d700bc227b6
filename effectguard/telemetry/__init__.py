"""What the call path reports: the :class:`Observer` protocol it calls, and the
Prometheus metrics that implement it and read gauges from the ledger."""
