"""chronoq: a durable message broker for delayed and scheduled messages.

The compiled hot path: the modules named in ``COMPILED_MODULES`` are plain Python source that the
install (setup.py) also compiles with Cython into extension modules beside it, from the same file.
Python's own import prefers an extension module to a ``.py`` of the same name, so an installed
chronoq runs them compiled. One seam decides otherwise, ``_SourceFirst`` below, a finder placed
first on ``sys.meta_path`` that loads such a module from its ``.py`` source when:

- ``CHRONOQ_PURE_PYTHON=1`` is set (the pure-Python fallback: the protocol and codec tests run
  against both builds; a machine without a C compiler installs and runs chronoq this way); or
- the ``.py`` is not the source its compiled module was built from (an edit or a checkout since
  the last install; the install records each source's SHA-256 in ``compiled-sources.json``):
  compiled code of another source must never run; a warning names the module and says to re-run
  ``scripts/setup``.

``compiled()`` and ``build()`` say which build runs (the ``chronoq_build_info`` metric carries it).
"""

from __future__ import annotations

import os as _os
import sys as _sys

__version__ = "0.1.0"

# The one list of compiled modules: setup.py reads it (without importing chronoq) to build them.
# A module here is a codec or a core measured to pay (README "The compiled hot path"). Compiled
# without C types, Cython pays on byte and integer work (varints, frames, HPACK, records) and not
# on attribute-heavy classes and coroutines, where CPython 3.11's specialising interpreter is as
# fast (callgrind: h2/flow.py compiled that way cost the server 1% more instructions a call,
# server/h2server.py 2%; with messaging, store/writing and pop/ too it ran slower). With C types
# (an augmenting .pxd beside the module: cdef classes with typed state, C calls between them) they
# pay: the HTTP/2 server (flow, h2streams, h2server, h2calls, callstats, with frames, hpackdec
# and grpcmsg typed) and broker/sending took
# bench/official_replay.py --lone --callgrind from 562k to 493k instructions a lone delayed send,
# the official client's receive+ack replay from 47 to 35 us of CPU a call (6 pairs), the HTTP/2
# path alone (bench/h2_path.py) from 18 to 12 us, an embedded lone send (bench/append.py
# --policy async --batch 1) from 24 to 19 us. Not the lone durable send of bench/send_receive.py
# --phase f (8 pairs: no change): there the loop sleeps through each fsync and runs cold after it,
# and its time follows the code and data it touches, not its instruction count. The same typing
# of broker/committer saved 1.6% of the lone send's instructions: not worth a cdef class.
# The client's side of a single send (bench/client_encode.py --callgrind --calls 2000, instructions
# per Client.send_batch of one delayed message over h2channel): 143.9k, then 125.9k with
# client/h2channel typed, 124.6k with h2/hpackenc's literal typed, 120.3k with client/client
# compiled, 113.5k with rocketmq/outgoing and fields typed, 107.0k with the answer read by hand
# (outgoing.send_results), 104.8k with core/msgid compiled.
# broker/resends is the part of broker/sending that answers resends, moved out of it and compiled
# as it was: a resent message (a scratch batch of 50 resends under callgrind) took 60.1-60.3k
# instructions before the move, 60.3-60.5k after, 61.9k had it stayed pure Python.
# broker/dedupe typed (a cdef class, its columns typed memoryviews: C loads and stores, not a
# memoryview item object per access): bench/append.py --callgrind --ids --batch 32 (batches of 32
# 1 KiB messages with client ids) from 51.2-51.3k to 46.6-46.9k instructions a message (72.3-72.6k
# to 67.8k delayed); a lone send (bench/official_replay.py --lone --callgrind) from 501-502k to 490-493k (2 runs each).
# store/writing compiled as it is (no .pxd; it ran slower once beside messaging and pop/, above),
# measured alone on top of that: bench/append.py --callgrind --batch 1 (a lone embedded send)
# 213.5k -> 207.0k instructions plain, 251.5k -> 250.0k delayed; --ids --batch 32 46.6k -> 46.1k
# plain, 67.8k delayed either way; the lone server send above 490-493k -> 485-487k.
# timer/handle typed (handle.pxd: a batch's recall handles laid out, CRC'd and base64'd in C):
# one handle 21.1k -> 6.5k instructions (a scratch loop of encode_many calls), the lone server
# send 484.3k -> 472.5k. store/record's encode_batch in C (record.pxd: the header laid out and
# CRC'd in place): a lone 1 KiB record 15.4k -> 7.9k instructions, the lone server send -> 463.7k.
# timer/schedlog typed (schedlog.pxd: a delayed record's MESSAGE entry laid out and CRC'd in C):
# encode_messages of one 10.8k -> ~3k, the lone server send -> 455.7k. protocol/rocketmq/send's
# answer (send.pxd: SendMessageResponse's entries written into one C buffer): one entry 12.8k ->
# ~5k, the lone server send 454.7k -> 447.3k (a fresher recording).
# The consumer's side (bench/official_replay.py --lone --callgrind: phase (f)'s receive of one
# message and its ack, one pair): 716.7k, then 700.6k with ReceiveBatch a coroutine (no async
# generators), 662.5k with h2/hpackdec taking fields from the block before the previous one too
# (its prefixes compared in C), 646.5k with protocol/rocketmq/receive's message answer written
# in C (receive.pxd: messages_bytes 31.6k -> 19.1k instructions for one message).
# broker/trace compiled, a receive's and an ack's events appended in one C loop (trace.pxd's
# _add_refs_in_c, not column extends with temporary lists and arrays): that pair 645.4k ->
# 596.7k; the official client's recording (receives of 32, acks of one) 353.2k -> 329.2k a call;
# the kept send batches spilled as events in C too (_add_runs_in_c): the lone send 454.6k -> 443.2k.
COMPILED_MODULES = (
    "chronoq.protocol.h2.frames",
    "chronoq.protocol.h2.hpackdec",
    "chronoq.protocol.h2.hpackenc",
    "chronoq.protocol.h2.grpcmsg",
    "chronoq.protocol.h2.flow",
    "chronoq.protocol.rocketmq.fields",
    "chronoq.protocol.rocketmq.send",
    "chronoq.protocol.rocketmq.receive",
    "chronoq.protocol.rocketmq.ack",
    "chronoq.protocol.rocketmq.outgoing",
    "chronoq.store.record",
    "chronoq.store.routing",
    "chronoq.store.fsyncer",
    "chronoq.timer.schedlog",
    "chronoq.timer.handle",
    "chronoq.client.answer",
    "chronoq.client.h2channel",
    "chronoq.client.client",
    "chronoq.core.msgid",
    "chronoq.server.h2streams",
    "chronoq.server.h2server",
    "chronoq.server.h2calls",
    "chronoq.server.callstats",
    "chronoq.broker.sending",
    "chronoq.broker.resends",
    "chronoq.broker.dedupe",
    "chronoq.broker.trace",
    "chronoq.store.writing",
)

PURE_PYTHON_ENV = "CHRONOQ_PURE_PYTHON"
_PURE = _os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


# Written by the install beside this file: {module: SHA-256 of the .py it was compiled from}.
BUILT_SOURCES_FILE = "compiled-sources.json"


def source_digest(path: str) -> str:
    """What BUILT_SOURCES_FILE records of a module's source: the SHA-256 of its ``.py`` followed
    by its ``.pxd`` when it has one (the C types Cython compiled it with), and then of the ``.py``
    and ``.pxd`` of each chronoq module that ``.pxd`` cimports, and so on (setup.py computes it
    the same way). A module compiled against another's C types is stale when that one is: run
    from source beside it, the C type it expects (``h2server.Connection`` extends
    ``h2streams.Answers``) would be a Python class, and its import would fail."""
    import hashlib
    import re

    digest = hashlib.sha256()
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    todo, seen = [path], set()
    while todo:
        source = todo.pop(0)
        if source in seen:
            continue
        seen.add(source)
        for name in (source, source[:-3] + ".pxd"):
            try:
                with open(name, "rb") as fh:
                    text = fh.read()
            except FileNotFoundError:
                if name == path:
                    raise
                continue
            digest.update(text)
            if name.endswith(".pxd"):
                for module in sorted(set(re.findall(rb"^\s*(?:from\s+(chronoq[\w.]*)\s+)?cimport\b", text, re.M))):
                    if module:
                        todo.append(_os.path.join(root, *module.decode().split(".")) + ".py")
    return digest.hexdigest()


class _SourceFirst:
    """Loads a module of COMPILED_MODULES from its ``.py`` when the pure build is asked for or
    the compiled module was built from another source than the one beside it (the content, not
    the times: a checkout or a wheel's unpacking sets times in any order); otherwise defers to
    the normal finders, which pick the extension module."""

    names = frozenset(COMPILED_MODULES)
    stale: list[str] = []  # modules whose compiled build was not of their source
    built: dict | None = None  # BUILT_SOURCES_FILE, read on first use

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname not in cls.names or not path:
            return None
        from importlib.machinery import EXTENSION_SUFFIXES
        from importlib.util import spec_from_file_location

        leaf = fullname.rpartition(".")[2]
        for entry in path:
            source = _os.path.join(entry, leaf + ".py")
            if not _os.path.exists(source):
                continue
            if not _PURE:
                if not any(_os.path.exists(_os.path.join(entry, leaf + suffix)) for suffix in EXTENSION_SUFFIXES):
                    return None  # never compiled: the normal finders load the source
                if cls._built().get(fullname) == source_digest(source):
                    return None  # compiled from this very source: the normal finders load it
                cls.stale.append(fullname)
                import warnings
                warnings.warn(f"chronoq: {fullname} (or a module it is compiled against) changed since it was "
                              "compiled; running its Python source (slower). Re-run scripts/setup to compile it "
                              "again.", RuntimeWarning, stacklevel=2)
            return spec_from_file_location(fullname, source)
        return None

    @classmethod
    def _built(cls) -> dict:
        if cls.built is None:
            import json

            try:
                with open(_os.path.join(_os.path.dirname(__file__), BUILT_SOURCES_FILE), encoding="utf-8") as fh:
                    cls.built = json.load(fh)
            except (OSError, ValueError):
                cls.built = {}  # no record of the build: no compiled module can be trusted
        return cls.built


_sys.meta_path.insert(0, _SourceFirst)


def compiled_modules() -> dict[str, bool]:
    """Each module of COMPILED_MODULES (imported here if it was not yet) -> whether it runs compiled."""
    import importlib
    from importlib.machinery import ExtensionFileLoader

    return {name: isinstance(importlib.import_module(name).__spec__.loader, ExtensionFileLoader)
            for name in COMPILED_MODULES}


def build() -> str:
    """Which build runs: "compiled" (every module of COMPILED_MODULES), "pure" (none: the fallback
    forced, or an install without the compiled build) or "mixed" (some stale, see _SourceFirst)."""
    kinds = set(compiled_modules().values())
    return "mixed" if len(kinds) > 1 else "compiled" if True in kinds else "pure"


def compiled() -> bool:
    """Whether this chronoq runs its hot path compiled: every module of COMPILED_MODULES."""
    return build() == "compiled"
