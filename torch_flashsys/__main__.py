"""``python -m torch_flashsys``: print an environment report to paste into bug reports."""

import sys

from torch_flashsys._env import main

if __name__ == "__main__":
    sys.exit(main())
