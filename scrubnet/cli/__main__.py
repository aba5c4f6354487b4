"""``python -m scrubnet.cli …``: the ``scrubnet`` command."""
import sys

from scrubnet.cli import main

sys.exit(main())
