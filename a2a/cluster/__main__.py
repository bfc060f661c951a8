"""``python -m a2a.cluster``: up, run, link, rate, kill, status, down (see the package's docstring)."""

from __future__ import annotations

import argparse
import sys

from . import __doc__ as DOC
from . import faults, launch, nodes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m a2a.cluster", description=DOC.split("\n\n")[0],
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="verb", required=True)
    p_up = sub.add_parser("up", help="make N nodes")
    p_up.add_argument("nodes", type=int)
    p_up.add_argument("--rate", help="shape every link to this rate (e.g. 1gbit, 10gbit)")
    p_run = sub.add_parser("run", help="an MPI job across the nodes: run --nodes N --ranks-per-node L -- cmd")
    p_run.add_argument("--nodes", type=int, required=True)
    p_run.add_argument("--ranks-per-node", type=int, default=1)
    p_run.add_argument("--rate", help="the links' rate, when run brings the cluster up itself")
    p_run.add_argument("--ft", action="store_true",
                       help="Open MPI's fault tolerance (--with-ft ulfm): a rank whose peer's process failed gets "
                       "an error instead of being aborted")
    p_link = sub.add_parser("link", help="a fault: take NODE's link down, or bring it up")
    p_link.add_argument("node", help="index, name or address")
    p_link.add_argument("state", choices=("up", "down"))
    p_rate = sub.add_parser("rate", help="shape NODE's link to RATE (or 'none' to unshape it)")
    p_rate.add_argument("node", help="index, name or address")
    p_rate.add_argument("rate")
    p_kill = sub.add_parser("kill", help="a fault: SIGKILL every process of NODE")
    p_kill.add_argument("node", help="index, name or address")
    sub.add_parser("down", help="remove everything (idempotent)")
    sub.add_parser("status", help="what is up")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.verb == "up":
            nodes.up(args.nodes, args.rate)
        elif args.verb == "down":
            nodes.require_rights()
            nodes.down()
        elif args.verb == "status":
            print(nodes.status())
        elif args.verb == "link":
            faults.set_link(args.node, args.state)
        elif args.verb == "rate":
            faults.set_rate(args.node, None if args.rate == "none" else args.rate)
        elif args.verb == "kill":
            print(f"cluster: killed {faults.kill_node(args.node)} process(es)")
        else:
            if not command:
                p.error("run needs a command after --")
            return launch.run(args.nodes, args.ranks_per_node, command, args.rate, ft=args.ft)
    except ValueError as error:
        print(str(error), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
