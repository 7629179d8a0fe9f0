"""``fsutil.atomic_write`` from several threads at once, as the broker does (an admin call writing
offsets.json while a checkpoint job writes it too): every write lands whole, none fails."""

from __future__ import annotations

import threading

from chronoq.core import fsutil


def test_threads_writing_one_file_take_turns_and_each_write_lands_whole(tmp_path):
    path = str(tmp_path / "offsets.json")
    payloads = [bytes([65 + i]) * (256 << 10) for i in range(3)]  # big enough to overlap
    start = threading.Barrier(len(payloads))
    failures: list[BaseException] = []

    def writer(data: bytes) -> None:
        start.wait()
        try:
            for _ in range(40):
                fsutil.atomic_write(path, data)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            failures.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[:3]  # (shared temp file: FileNotFoundError on the second rename)
    with open(path, "rb") as fh:
        assert fh.read() in payloads  # one write, whole
