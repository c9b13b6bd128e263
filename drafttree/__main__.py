"""`python -m drafttree ...`: the `drafttree` command."""
from drafttree.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
