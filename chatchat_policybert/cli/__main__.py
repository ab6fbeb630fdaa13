"""``python -m chatchat_policybert.cli``: the console script, run by a given interpreter (tune and eval start setup
so)."""

import sys

from chatchat_policybert.cli import main

sys.exit(main())
