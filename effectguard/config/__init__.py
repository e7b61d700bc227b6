"""Configuration, read once at the edge: the one set of defaults, and the typed settings
that ``effectguard serve``, the CLI and the transports are built from."""
