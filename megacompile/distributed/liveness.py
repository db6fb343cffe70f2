"""Which rank to blame when a collective fails: a roll call over the process group's store.

A collective that fails or times out says little: gloo reports "connection reset by peer" with an
address, NCCL a timeout. Every process therefore keeps a roll-call thread that watches the store
(the one init_process_group made: a TCPStore under torchrun, held by the launcher) for a call, and
answers each with what its threads are doing: per thread, how many collectives it entered and the
one it is in. The rank whose collective failed calls the roll and waits ANSWER_WAIT seconds:

    no answer                      the rank's process died, or is frozen whole (stopped, swapped out)
    answers, fewer collectives on  the rank is alive but never reached this collective: it hangs,
    the failing thread             or runs something the others do not

The watch costs a read of one key every POLL seconds and writes nothing; a call writes a key per
rank. Every store access of the caller runs in a thread of its own, joined with a bound, so a
store that went down with its host cannot hang the error that reports it.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time

import torch.distributed as dist

CALLS = "megacompile/roll-calls"         # counter: the number of the latest call
CALL = "megacompile/roll-call/{}"        # present once call n is made
ANSWER = "megacompile/roll-call/{}/{}"   # call n, global rank r: its progress (JSON)
POLL = 0.25                              # s between two looks of the watch
ANSWER_WAIT = 3.0                        # s a caller waits for the answers: many POLLs, and time for
                                         # a thread of a busy process to get the interpreter lock


class Progress:
    """This process's collectives, per thread (each group's collectives come from one thread:
    the compute thread, the host stream, the network stream; group.py), and the watch that
    answers roll calls with them."""

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank
        self.entered: dict[str, int] = {}
        self.inside: dict[str, str | None] = {}
        self._thread = threading.Thread(target=self._watch, name="megacompile-roll-call", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def collective(self, what: str):
        """Count and name a collective of the calling thread while it runs."""
        thread = threading.current_thread().name
        self.entered[thread] = self.entered.get(thread, 0) + 1
        self.inside[thread] = what
        try:
            yield self.entered[thread]
        finally:
            self.inside[thread] = None

    def answer(self) -> dict:
        return {t: [n, self.inside.get(t)] for t, n in list(self.entered.items())}

    def _watch(self) -> None:
        call = 1
        while _current(self.store):
            try:
                while self.store.check([CALL.format(call)]):
                    self.store.set(ANSWER.format(call, self.rank), json.dumps(self.answer()))
                    call += 1
            except Exception:  # noqa: BLE001 - the store is gone: nothing is left to answer
                return
            time.sleep(POLL)


_progress: Progress | None = None
_lock = threading.Lock()


def progress(store, rank: int) -> Progress:
    """The process's Progress (one per process group: a new one after init_process_group again)."""
    global _progress
    with _lock:
        if _progress is None or _progress.store is not store:
            _progress = Progress(store, rank)
        return _progress


def _current(store) -> bool:
    try:
        return dist.is_initialized() and dist.distributed_c10d._get_default_store() is store
    except Exception:  # noqa: BLE001 - torch is tearing the group down
        return False


def roll_call(store, members: list[int], me: int) -> dict[int, dict | None] | None:
    """Call the roll of the global ranks `members` but `me`: each one's answer (its Progress, by
    thread), or None where none came in ANSWER_WAIT seconds. None when the store itself did not
    answer (it went down with the process or node that held it)."""
    out: dict = {}

    def ask() -> None:
        call = store.add(CALLS, 1)
        store.set(CALL.format(call), "")
        keys = {r: ANSWER.format(call, r) for r in members if r != me}
        answers = dict.fromkeys(keys)
        deadline = time.monotonic() + ANSWER_WAIT
        while True:
            for r, key in keys.items():
                if answers[r] is None and store.check([key]):
                    answers[r] = json.loads(store.get(key))
            if all(a is not None for a in answers.values()) or time.monotonic() > deadline:
                break
            time.sleep(POLL / 5)
        out["answers"] = answers

    thread = threading.Thread(target=ask, name="megacompile-roll-call-ask", daemon=True)
    thread.start()
    thread.join(ANSWER_WAIT + 5.0)
    return out.get("answers")


def blame(answers: dict[int, dict | None] | None, thread: str, entered: int, rank_of: dict[int, int]) -> str | None:
    """Who the roll call names, in words (None: every rank answered and none is behind).
    thread, entered: the failing thread's name and the number of the collective it was in;
    rank_of: global rank -> rank in the group."""
    if answers is None:
        return ("the process group's store did not answer either: the process or node that holds it "
                "(the launcher's, or rank 0's without a launcher) is gone")
    dead = [rank_of[r] for r, a in sorted(answers.items()) if a is None]
    if dead:
        return (f"rank{'s' * (len(dead) > 1)} {', '.join(map(str, dead))} did not answer within "
                f"{ANSWER_WAIT:.0f} s: {'its process' if len(dead) == 1 else 'their processes'} died or froze")
    behind = {rank_of[r]: a.get(thread, [0, None]) for r, a in sorted(answers.items())
              if a.get(thread, [0, None])[0] < entered}
    if not behind:
        return None
    said = []
    for rank, (n, inside) in behind.items():
        where = f"in collective {n}, {inside}" if inside else f"past collective {n}, in no collective"
        said.append(f"rank {rank} is alive but never reached it (its {thread} thread is {where}; this "
                    f"rank waited in collective {entered})")
    return "; ".join(said) + ": it hangs, or runs something the others do not"
