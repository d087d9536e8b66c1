"""`python -m dr.reconcile ...` and `spark-submit dr/reconcile/__main__.py ...`: the same
options as `dr reconcile`. Under spark-submit the submitted master and jars are used."""

from __future__ import annotations

import sys


def main() -> None:
    from dr.cli import main as dr_main
    sys.argv = [sys.argv[0], "reconcile", *sys.argv[1:]]
    dr_main()


if __name__ == "__main__":
    main()
