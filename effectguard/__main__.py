"""``python -m effectguard``: the command line."""

from effectguard.ops.cli import main

raise SystemExit(main())
