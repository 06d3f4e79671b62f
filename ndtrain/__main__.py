"""`python -m ndtrain` is the `ndtrain` command (also how launched workers start)."""

from ndtrain.cli import main

raise SystemExit(main())
