"""Process plumbing so that a failed or hung rank ends the whole job, and no process is left behind.

Lightning's popen launcher already kills everything when a *child* rank exits with an error. Two gaps remain:
when the launching process (rank 0) fails, its children are left waiting in a collective until the timeout; and
when the launching process is killed, its children never notice. The launcher below kills its children when
rank 0 fails, and children it starts watch their parent and exit when it is gone.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable, Optional

from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

PARENT_PID_VARIABLE = "DDP_PLUS_LAUNCHER_PID"


class KillChildrenOnFailureLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher, plus: if rank 0 fails, its child ranks are killed before the error propagates."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:
            os.environ[PARENT_PID_VARIABLE] = str(os.getpid())  # inherited by the children it starts
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException:
            self.kill(signal.SIGKILL)
            raise


def watch_parent(poll_seconds: float = 1.0) -> Optional[threading.Thread]:
    """In a child rank started by ``KillChildrenOnFailureLauncher``: exit as soon as the launching process is gone."""
    expected = os.environ.get(PARENT_PID_VARIABLE)
    if expected is None or int(expected) != os.getppid() or int(expected) == os.getpid():
        return None

    def run() -> None:
        while os.getppid() == int(expected):
            time.sleep(poll_seconds)
        os._exit(1)  # the launcher died: nobody will complete this rank's collectives

    thread = threading.Thread(target=run, name="ddp-plus-parent-watch", daemon=True)
    thread.start()
    return thread
