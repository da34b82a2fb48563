"""`python -m agentrl`: the command line (agentrl.cli)."""

import sys

from agentrl.cli import main

if __name__ == "__main__":  # importing the module (documentation tools walk every module) runs nothing
    sys.exit(main())
