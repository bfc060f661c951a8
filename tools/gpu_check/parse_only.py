"""The dry run's stand-in for a GPU benchmark: the benchmark's own parser
reads the arguments of the GPU run, and nothing runs.

    python parse_only.py a2a.bench --device cuda ...
    python parse_only.py moe_runtime.bench --device cuda ...

Exits 2 with the parser's message when the arguments do not parse."""

from __future__ import annotations

import importlib
import sys

# The module whose parse_args(argv) reads each benchmark's command line.
PARSERS = {"a2a.bench": "a2a.bench.__main__", "moe_runtime.bench": "moe_runtime.bench.__main__"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in PARSERS:
        print(f"parse_only.py: expected one of {', '.join(PARSERS)}, got {argv[:1]}", file=sys.stderr)
        return 2
    parsed = importlib.import_module(PARSERS[argv[0]]).parse_args(argv[1:])
    print(f"{argv[0]}: the arguments of the GPU run parse (device {getattr(parsed, 'device', '?')})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
