import sys

from loomserve.entrypoints.cli import main

sys.exit(main())
