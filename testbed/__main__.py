"""`python -m testbed list|sweep`: the testbed namespaces on this machine, and removal of
those whose owner process is gone (what a SIGKILLed run leaves; live testbeds are never touched)."""

from __future__ import annotations

import argparse
import sys

from testbed.commands import namespaces, registered, require_available, stale_namespaces, sweep


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["list", "sweep"])
    args = ap.parse_args()
    require_available()
    stale = stale_namespaces()
    if args.action == "list":
        existing = set(namespaces())
        for names in registered().values():
            for ns in names:
                if ns in existing:
                    print(f"{ns}\t{'stale (owner gone)' if ns in stale else 'live'}")
        return 0
    removed = sweep(stale)
    for ns in removed:
        print(f"removed {ns}")
    for ns in sorted(set(stale) - set(removed)):
        print(f"{ns}: processes still run inside; left alone", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
