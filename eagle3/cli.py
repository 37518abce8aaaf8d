"""How every stage starts: --help, no unknown arguments, and bad input as one clear line."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from eagle3.errors import PipelineError


def run_stage(name: str, doc: str | None, main: Callable[[], None], argv: list[str] | None = None) -> None:
    """Run a stage's `main`. A stage takes no arguments (params.yaml is its input): --help prints its
    docstring and any argument is refused before the stage touches a file. A PipelineError (bad
    params, inputs or environment) ends the process with one line `name: message` and exit code 1."""
    argparse.ArgumentParser(prog=f"python -m stages.{name}", description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=f"Reads the `{name}` section of params.yaml (EAGLE3_PARAMS names another "
                                   "file); docs/stages.md describes every stage.").parse_args(argv)
    try:
        main()
    except PipelineError as err:
        sys.exit(f"{name}: {err}")
