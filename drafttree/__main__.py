"""`python -m drafttree ...`: the `drafttree` command."""
from drafttree.entry import main

if __name__ == "__main__":
    raise SystemExit(main())
