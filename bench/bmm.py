"""The BMM benchmark as a script: ``python bench/bmm.py [--quick] [--json] ...`` = ``mlaq bench-bmm ...``.

Results of a full run, with the machine named: bench/RESULTS.md.
"""

import sys

from mlaq.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-bmm", *sys.argv[1:]]))
