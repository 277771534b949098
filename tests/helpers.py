"""Helpers shared by the serving tests."""

import time


def wait_idle(sched, timeout: float = 30.0) -> bool:
    """Whether the scheduler has nothing waiting, running or in flight within `timeout` seconds."""
    t = time.time() + timeout
    while time.time() < t:
        if sched.idle():
            return True
        time.sleep(0.01)
    return False
