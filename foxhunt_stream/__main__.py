"""``python -m foxhunt_stream``: the command line (see ``foxhunt_stream.cli``)."""

import sys

from .cli.main import main

sys.exit(main())
