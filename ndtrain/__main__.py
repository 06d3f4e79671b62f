"""`python -m ndtrain` is the `ndtrain` command (also how launched workers start)."""

from ndtrain.cli.commands import main

raise SystemExit(main())
