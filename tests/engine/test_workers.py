"""Worker threads parked between jobs (engine.workers): reused, named while they work, holding
nothing of a finished task, gone after their idle time, and none inherited by a forked child."""

import gc
import os
import threading
import time
import weakref

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.engine import pipeline, workers


def _quiet_pool(timeout: float = 10.0) -> None:
    """Wait until no worker is between its task and its parking place."""
    deadline = time.monotonic() + timeout
    while any(t.name != workers.IDLE_NAME and t.name.startswith("foxhunt-test") for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_task_runs_on_a_parked_thread_named_while_it_works():
    seen = []
    workers.run(lambda: seen.append(threading.current_thread()), "foxhunt-test-a").join(10)
    first = seen[0]
    assert first.name == workers.IDLE_NAME and first.is_alive()   # parked, not exited
    task = workers.run(lambda: seen.append((threading.current_thread(), threading.current_thread().name)),
                       "foxhunt-test-b")
    assert task.join(10) and task.done()
    assert seen[1] == (first, "foxhunt-test-b")   # the same thread, renamed for the task


def test_jobs_reuse_their_workers_instead_of_starting_threads():
    def idents(n):
        got, lock = set(), threading.Lock()

        def work(w, item):
            with lock:
                got.add(threading.get_ident())
            time.sleep(0.02)   # every worker takes an item
        pipeline.Job(list(range(n)), work, n, name="foxhunt-test").start().wait(30)
        return got

    first = idents(4)
    before = set(threading.enumerate())
    second = idents(4)
    assert len(first) == len(second) == 4 and second == first
    # No thread started; an idle worker parked by an earlier test may exit meanwhile.
    assert set(threading.enumerate()) <= before


def test_a_parked_worker_keeps_nothing_of_its_last_task():
    class Payload:
        pass
    payload = Payload()
    ref = weakref.ref(payload)
    workers.run(lambda p=payload: p, "foxhunt-test-hold").join(10)
    del payload
    gc.collect()
    assert ref() is None


def test_a_task_waiting_on_a_later_task_gets_its_own_thread():
    """No bound on the threads: a job whose worker waits for another job's never deadlocks."""
    later_ran = threading.Event()
    first = workers.run(lambda: later_ran.wait(10), "foxhunt-test-wait")
    workers.run(later_ran.set, "foxhunt-test-set").join(10)
    assert first.join(10) and later_ran.is_set()


def test_an_idle_worker_exits_after_its_keep_time(monkeypatch):
    monkeypatch.setattr(workers, "KEEP_IDLE_S", 0.05)
    seen = []
    workers.run(lambda: seen.append(threading.get_native_id()), "foxhunt-test-exit").join(10)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/self/task/{seen[0]}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/self/task/{seen[0]}")


def test_an_escaping_error_leaves_the_worker_serving(caplog):
    def boom():
        raise RuntimeError("escaped")
    seen = []
    with caplog.at_level("ERROR", logger="foxhunt_stream"):
        workers.run(boom, "foxhunt-test-boom").join(10)
    workers.run(lambda: seen.append(1), "foxhunt-test-after").join(10)
    assert seen == [1] and "escaped" in caplog.text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_without_the_parents_parked_threads(tmp_path):
    path = str(tmp_path / "f.safetensors")
    x = np.arange(1 << 16, dtype=np.float32)
    fs.save_file({"x": x}, path)
    fs.load_file(path, threads=2)
    _quiet_pool()
    assert workers.parked() >= 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: its load must start threads of its own, not wait on the parent's
        try:
            ok = workers.parked() == 0 and np.array_equal(fs.load_file(path, threads=2)["x"], x)
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and status == 0
    os.close(r)
