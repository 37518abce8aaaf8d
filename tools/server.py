"""`make serve` / `make stop` / `make status`: the inference server for artifacts/target, by hand.

    python -m tools.server serve     # start vLLM with params.yaml `serve`, wait until it answers
    python -m tools.server serve-capture  # the same server with hidden-state capture on, for extract.engine: vllm
                                          # (it answers generate's requests too: one model load for both stages)
    python -m tools.server stop      # stop the server this project started, wait until its port is free
    python -m tools.server status    # is one up (which model, since when)? where a generation stands
"""
from __future__ import annotations

import argparse
import sys

from eagle3.engine import server
from eagle3.engine.state import status_lines
from eagle3.errors import PipelineError
from eagle3.extraction.engine import captured_layer_ids, start_capture_server
from eagle3.extraction.params import ExtractParams
from eagle3.extraction.samples import resolve_aux_ids
from eagle3.generation.status import progress_lines
from eagle3.params import load_section
from eagle3.target.record import load_record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["serve", "serve-capture", "stop", "status"], nargs="?", default="status")
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            server.start(load_section("serve", server.ServeParams), load_record())
        elif args.command == "serve-capture":
            record = load_record()
            aux_ids = resolve_aux_ids(load_section("extract", ExtractParams), record)
            start_capture_server(load_section("serve", server.ServeParams), record,
                                 captured_layer_ids(aux_ids, record["num_layers"]))
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
