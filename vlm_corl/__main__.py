"""`python -m vlm_corl COMMAND ...`: the `corl` command itself (its table, flags and exit codes), for where the
console script is not on PATH (a launcher's `-m`, a venv not activated)."""

import sys

from vlm_corl.commands import main

sys.exit(main())
