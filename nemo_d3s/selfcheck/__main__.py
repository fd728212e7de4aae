"""``python -m nemo_d3s.selfcheck``."""

import sys

from nemo_d3s.selfcheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
