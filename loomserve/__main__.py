import sys

from loomserve.cli import main

sys.exit(main())
