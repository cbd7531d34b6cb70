"""``python -m agent`` runs the same command line as the ``gpu-dra-agent`` script."""

import sys

from agent.cli import main

sys.exit(main())
