"""``python -m deploy`` is the ``graphfleet`` command."""

import sys

from deploy.cli import main

sys.exit(main())
