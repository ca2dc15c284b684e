"""The scheduler benchmark (thin wrapper over ``opsched bench scheduler``; see --help)."""

from __future__ import annotations

import sys

from opsched.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "scheduler", *sys.argv[1:]]))
