import sys

from loomserve.cli import main

# Guarded: the engine core's process is spawned, and spawn imports the parent's __main__.
if __name__ == "__main__":
    sys.exit(main())
