"""The kernels benchmark (thin wrapper over ``opsched bench kernels``; same options, see --help)."""

from __future__ import annotations

import sys

from opsched.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "kernels", *sys.argv[1:]]))
