"""The graphs benchmark (thin wrapper over ``opsched bench graphs``; same options, see --help)."""

from __future__ import annotations

import sys

from opsched.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "graphs", *sys.argv[1:]]))
