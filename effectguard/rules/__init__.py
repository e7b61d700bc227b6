"""Pure rules: exact money, events and their digests, usage and cost, the work-state
projection, budget arithmetic and admission decisions. Values in, values out: no I/O,
no clock, and no import from effectguard except :mod:`effectguard.errors`."""
