"""A rank started by torchrun stops when its launcher is gone: torchrun's agent killed with
SIGKILL leaves its workers running, unattended (no one restarts, stops or collects them). The
watch sends this process SIGTERM, so the run stops as on a job's SIGTERM (a checkpoint,
``interrupted.json``, exit 75). A run started by a shell is left alone: a shell that exits
(``nohup``, ``&``) is not a launcher going away.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Optional

__all__ = ["watch_launcher"]

log = logging.getLogger("nemo_d3s.trainer")


def watch_launcher(interval_s: float = 1.0) -> Optional[threading.Event]:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set): a daemon thread that checks every
    ``interval_s`` whether the parent process changed; set the returned event to end it.
    None elsewhere."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    parent, done = os.getppid(), threading.Event()

    def watch() -> None:
        while not done.wait(interval_s):
            if os.getppid() != parent:
                log.warning(
                    "the torchrun agent (pid %d) that started this rank is gone: stopping at a "
                    "checkpoint, as on SIGTERM",
                    parent,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
    return done
