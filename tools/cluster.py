#!/usr/bin/env python3
"""The namespace cluster's command (``python -m a2a.cluster``, a2a/cluster/): a
cluster of N nodes on this machine, each a network namespace, joined by a
bridge; see ``python tools/cluster.py --help``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from a2a.cluster.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
