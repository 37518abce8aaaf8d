"""The one base class of errors that are the user's input or environment, not a bug.

An entry point (eagle3/cli.py) prints such an error as one line naming the file, row, param or
process at fault and exits 1; any other exception keeps its traceback, because it is ours to fix.
"""


class PipelineError(Exception):
    pass
