"""``python3 -m ssmcraft``: the ``ssmcraft`` command, as ``torchrun -m ssmcraft train SPEC`` runs it."""
from ssmcraft.cli import main

raise SystemExit(main())
