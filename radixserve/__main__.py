"""``python -m radixserve ...``: the ``radixserve`` command (``radixserve/cli.py``)."""

import sys

from radixserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
