"""``python -m gradcomp.experiments.sweep CONFIG``: the same as ``gradcomp sweep CONFIG``."""

import sys

from gradcomp.experiments.sweep.command import main

sys.exit(main())
