"""The threads of this process that foxhunt started and that are still at work, for the tests
that a load or save leaves nothing running behind it."""

import threading

from foxhunt_stream.engine import workers


# the threads pinning a GPU's process-wide staging pool (``staging.StagingPool.fill_async``): a load
# starts them and takes the slots it needs; with a small ``chunk_bytes`` (16,384 slots of 16 KiB
# in 256 MiB) they go on pinning the rest for the next loads long after it ended
PINNING = "foxhunt-pin-"


def foxhunt_threads_at_work(prefix: str = "foxhunt") -> list[threading.Thread]:
    """Alive threads named ``prefix...``, but for the workers parked for the next job
    (``engine.workers``): they hold nothing of a finished one (tests/engine/test_workers.py), and
    the threads pinning a GPU's pool, which is the process's, not a load's."""
    return [t for t in threading.enumerate()
            if t.name.startswith(prefix) and t.name != workers.IDLE_NAME and not t.name.startswith(PINNING)
            and t.is_alive()]
