"""The threads of this process that foxhunt started and that are still at work, for the tests
that a load or save leaves nothing running behind it."""

import threading

from foxhunt_stream.engine import workers


def foxhunt_threads_at_work(prefix: str = "foxhunt") -> list[threading.Thread]:
    """Alive threads named ``prefix...``, but for the workers parked for the next job
    (``engine.workers``): they hold nothing of a finished one (tests/engine/test_workers.py)."""
    return [t for t in threading.enumerate()
            if t.name.startswith(prefix) and t.name != workers.IDLE_NAME and t.is_alive()]
