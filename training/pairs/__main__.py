"""``python -m training.pairs``."""

import sys

from chatchat_policybert.errors import run_cli
from training.pairs import main

sys.exit(run_cli(main))
