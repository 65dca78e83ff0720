"""``python -m rope_quant.cli``: the ``rope-quant`` command."""

import sys

from rope_quant.cli import main

sys.exit(main())
