"""`python -m drafttree ...`: the `drafttree` command."""
from drafttree.entry import command

if __name__ == "__main__":
    command()
