"""A pool process is forked from a worker whose threads may hold bb_broker's locks at that moment: every lock a
module or class keeps is a new, free one in the child (bb_broker.forks), or the child's first use waits forever."""

from __future__ import annotations

import importlib
import os
import pkgutil
import threading
import time
from collections.abc import Iterator

import bb_broker

#: The lock type of threading.Lock(); an RLock is never a module's lock here.
LOCK_TYPE = type(threading.Lock())
#: Flower runs in one process and forks no child that runs bb_broker: its locks need no reset.
NOT_FORKED = ("bb_broker.contrib",)


def module_locks() -> Iterator[tuple[str, object, str]]:
    """(where, owner, attribute) of every lock a bb_broker module or one of its classes holds as an attribute."""
    for info in pkgutil.walk_packages(bb_broker.__path__, "bb_broker."):
        if info.name.startswith(NOT_FORKED):
            continue
        module = importlib.import_module(info.name)
        for name, value in list(vars(module).items()):
            if isinstance(value, LOCK_TYPE):
                yield f"{info.name}.{name}", module, name
            elif isinstance(value, type) and value.__module__ == info.name:
                for attribute, held in list(vars(value).items()):
                    if isinstance(held, LOCK_TYPE):
                        yield f"{info.name}.{name}.{attribute}", value, attribute


def test_every_lock_a_parents_thread_holds_at_the_fork_is_free_in_the_child() -> None:
    locks = list(module_locks())
    assert len(locks) >= 10, [where for where, _, _ in locks]  # the scan finds them (clock, leases, store, ...)
    holding, release = threading.Event(), threading.Event()

    def hold_them_all() -> None:  # as a worker's lease keeper or loop thread would, mid-call
        for _, owner, attribute in locks:
            getattr(owner, attribute).acquire()
        holding.set()
        release.wait(60)
        for _, owner, attribute in locks:
            getattr(owner, attribute).release()

    holder = threading.Thread(target=hold_them_all)
    holder.start()
    assert holding.wait(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: every lock, looked up again, must be free
        os.close(read)
        stuck = [where for where, owner, attribute in locks if not getattr(owner, attribute).acquire(timeout=1)]
        os.write(write, ("\n".join(stuck) or "none").encode())
        os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + 60
        answer = b""
        while chunk := os.read(read, 65536):
            answer += chunk
            assert time.monotonic() < deadline
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join(10)
        os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert answer.decode() == "none", f"held in the child: {answer.decode()}"
