"""`make serve` / `make stop` / `make status`: the inference server for artifacts/target, by hand.

    python -m tools.server serve     # start vLLM with params.yaml `serve`, wait until it answers
    python -m tools.server stop      # stop the server this project started, wait until its port is free
    python -m tools.server status    # is one up (which model, since when)? where a generation stands
"""
from __future__ import annotations

import argparse
import sys

from eagle3.engine import server
from eagle3.engine.state import status_lines
from eagle3.errors import PipelineError
from eagle3.generation.status import progress_lines
from eagle3.params import load_section
from eagle3.target.record import load_record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["serve", "stop", "status"], nargs="?", default="status")
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            server.start(load_section("serve", server.ServeParams), load_record())
        elif args.command == "stop":
            print("stop: stopped the server" if server.stop() else "stop: no server was running", file=sys.stderr)
        else:
            print("\n".join(status_lines() + progress_lines()))
    except PipelineError as err:
        print(f"{args.command}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
