"""``nemo-d3s-selfcheck``: one command that exercises every CUDA path of the project (and its
CPU/gloo twin where there is no GPU) in a few minutes and says, per check, passed / failed /
not run, with what it measured. ``cli`` launches it; each ``*_checks`` module states what its
checks compare and their bounds; ``report`` holds the rules no check can bend.
"""

from nemo_d3s.selfcheck.cli import main

__all__ = ["main"]
