"""
What every command of the command line gets (L{Context}): its own module,
so that the commands in L{iop.cli.pull} and L{iop.cli.streams} can name it
without importing L{iop.cli.main}, which imports them.
"""

import argparse
import json
from typing import Any, TextIO

from rich.console import Console

from iop.cli.client import EdgeClient


class Context:
    """
    What every command gets: the Edge client, the parsed arguments and two
    consoles (stdout for results, stderr for everything else).
    """

    def __init__(self, args: argparse.Namespace, client: EdgeClient, stdout: TextIO, stderr: TextIO) -> None:
        self.args = args
        self.client = client
        self.stdout = stdout
        self.out = Console(file=stdout, highlight=False, soft_wrap=False)
        self.err = Console(file=stderr, highlight=False, stderr=True)

    def print_json(self, obj: Any) -> None:
        self.stdout.write(json.dumps(obj, indent=2) + "\n")
        self.stdout.flush()
