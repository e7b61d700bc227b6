"""The call path: prepare, admit, dispatch, observe and settle a request (the guard),
guarded streams, the wire shapes of answers, crash points, and this process as a
ledger worker (leases, heartbeat, sweeper)."""
