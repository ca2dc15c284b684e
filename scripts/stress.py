"""The stress test (thin wrapper over ``python -m opsched stress``; same options)."""

from __future__ import annotations

import sys

from opsched.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["stress", *sys.argv[1:]]))
