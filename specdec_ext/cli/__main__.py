"""`python -m specdec_ext.cli ARGS`: the `specdec` command without its console script."""
import sys

from . import main

sys.exit(main())
