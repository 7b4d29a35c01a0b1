"""`python -m swarmnode`: the same as the `swarmnode` console script."""

from swarmnode.cli import main

if __name__ == "__main__":
    main()
