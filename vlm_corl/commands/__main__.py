"""`python -m vlm_corl.commands COMMAND ...`: the `corl` table (what the `corl` console script runs)."""

import sys

from vlm_corl.commands import main

sys.exit(main())
