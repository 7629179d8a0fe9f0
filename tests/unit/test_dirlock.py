"""One process per data directory (chronoq.store.dirlock): a second opener is refused at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from chronoq.core import errors, fsutil
from chronoq.broker.broker import Broker
from chronoq.core.config import BrokerConfig
from chronoq.store.dirlock import LOCK_FILE, DirLock
from chronoq.store.store import CHECKPOINT_FILE

from storekit import open_store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _broker(path) -> Broker:
    return Broker(BrokerConfig(data_dir=str(path)))


def _lock_text(path) -> str:
    with open(os.path.join(path, LOCK_FILE)) as fh:
        return fh.read()


def test_a_second_broker_in_one_process_is_refused_until_the_first_closes(tmp_path):
    first = _broker(tmp_path)
    sent = first.send("orders", b"one")
    with pytest.raises(errors.DataDirLocked) as info:
        _broker(tmp_path)
    err = info.value
    assert isinstance(err, errors.StorageError)
    assert err.data_dir == str(tmp_path) and err.in_this_process and err.holder_pid == os.getpid()
    assert str(tmp_path) in err.message and f"PID {os.getpid()}" in err.message
    # The refused opener touched nothing: the first goes on, and its message is there.
    first.send("orders", b"two")
    assert [m.body for m in first.read("orders", sent.queue_id, 0, 10).messages][:1] == [b"one"]
    first.close()
    assert _lock_text(tmp_path) == ""  # a clean close empties the file; the file stays
    with _broker(tmp_path) as again:
        assert _lock_text(tmp_path) == f"{os.getpid()}\n"
        assert again.read("orders", sent.queue_id, 0, 10).messages[0].body == b"one"


def test_a_store_opened_directly_takes_the_lock_too(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(errors.DataDirLocked):
        open_store(tmp_path)
    with pytest.raises(errors.DataDirLocked):
        _broker(tmp_path)
    store.close()
    open_store(tmp_path).close()


def test_the_lock_is_on_the_directory_not_the_path(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    with _broker(real):
        with pytest.raises(errors.DataDirLocked):
            _broker(tmp_path / "link")
        with pytest.raises(errors.DataDirLocked):
            _broker(os.path.relpath(real))


def test_a_failed_open_gives_the_lock_back(tmp_path):
    _broker(tmp_path).close()
    with open(tmp_path / "topics.json", "w") as fh:
        fh.write("not json")
    with pytest.raises(errors.CorruptionError) as info:
        _broker(tmp_path)
    os.remove(tmp_path / "topics.json")
    # The failed broker is still referenced (by the traceback); its lock is not.
    assert info.value is not None
    _broker(tmp_path).close()


def _holder_script(data_dir: str) -> str:
    return textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        from chronoq.broker.broker import Broker
        from chronoq.core.config import BrokerConfig
        b = Broker(BrokerConfig(data_dir={data_dir!r}))
        b.send("orders", b"held")
        b.store.dispatch(b.store.sync())
        print(os.getpid(), flush=True)
        time.sleep(60)
    """)


def test_another_process_is_named_and_its_lock_dies_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _holder_script(str(tmp_path))], stdout=subprocess.PIPE,
                              text=True)
    try:
        pid = int(holder.stdout.readline())
        assert pid == holder.pid
        checkpoint = fsutil.read_json(os.path.join(tmp_path, CHECKPOINT_FILE))
        listing = sorted(os.listdir(tmp_path))
        with pytest.raises(errors.DataDirLocked) as info:
            _broker(tmp_path)
        assert info.value.holder_pid == pid and not info.value.in_this_process
        assert f"PID {pid}" in info.value.message and str(tmp_path) in info.value.message
        # Refused before anything was read or written.
        assert fsutil.read_json(os.path.join(tmp_path, CHECKPOINT_FILE)) == checkpoint
        assert sorted(os.listdir(tmp_path)) == listing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert _lock_text(tmp_path) == f"{pid}\n"  # a killed holder's PID stays, and blocks nobody
    with _broker(tmp_path) as broker:
        assert broker.read("orders", 0, 0, 10).messages or broker.read("orders", 1, 0, 10).messages
        assert _lock_text(tmp_path) == f"{os.getpid()}\n"


def test_the_lock_descriptor_does_not_leak_into_children(tmp_path):
    with _broker(tmp_path) as broker:
        assert not os.get_inheritable(broker.dir_lock._fd)  # O_CLOEXEC: gone at exec
        # fork without exec: the child closes its copy without unlocking (LOCK_UN on the shared
        # copy would drop the parent's lock); what it does with its Broker object changes nothing.
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                ok = not broker.dir_lock.held
                broker.dir_lock.release()
            except BaseException:
                ok = False
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with pytest.raises(errors.DataDirLocked):
            DirLock.acquire(str(tmp_path))
    DirLock.acquire(str(tmp_path)).release()


def test_a_forked_child_does_not_keep_a_killed_parents_lock(tmp_path):
    script = _holder_script(str(tmp_path)).replace(
        "print(os.getpid(), flush=True)",
        # The parent speaks once the child is past its fork hooks (a pipe): otherwise the parent
        # can be killed and the lock tried before the child has closed its copy of the lock.
        "r, w = os.pipe()\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    os.write(w, b'.'); time.sleep(60); os._exit(0)\n"
        "os.read(r, 1)\n"
        "print(os.getpid(), child, flush=True)")
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid, child = map(int, holder.stdout.readline().split())
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # still alive
        with _broker(tmp_path) as broker:  # the child lives on, without the lock
            assert broker.dir_lock.held
    finally:
        os.kill(child, signal.SIGKILL)
        holder.stdout.close()
