"""Worlds built one after another, some members leaving at once: the race of 2026-12-08.
Usage: ``python benchmarks/world_formation_race.py 6 150`` (members, worlds).

``members`` spawned processes join ``worlds`` worlds in a row through
``actors.wire.transport.join_world`` (the path of a vLLM worker and a user's trainer rank); in
each, members 0 and 1 exchange 4 KB and the others close the world at once, as a member with
nothing to send does. Before ``transport.built_together`` a member that left at once could close
its gloo pairs while another member was still connecting them ("Connection closed by peer"; 3 of
150 worlds with busy loops beside it, docs/benchmarks.md). Prints each failure and, per member,
how many worlds failed.
"""

from __future__ import annotations

import sys
import uuid

import torch
import torch.multiprocessing as mp

from actors.wire.transport import host_rendezvous, join_world

TIMEOUT_S = 20.0


def member(rank: int, size: int, port: int, worlds: list[str], queue) -> None:
    failed = 0
    for i, world in enumerate(worlds):
        try:
            transport = join_world("127.0.0.1", port, world, rank, size, TIMEOUT_S, "race")
            if rank in (0, 1):  # only 0 and 1 exchange; the others leave at once
                other = 1 - rank
                for request in transport.exchange((other, torch.ones(1000)), (other, torch.empty(1000))):
                    request.wait()
            transport.close()
        except Exception as err:  # noqa: BLE001 - counted and reported
            failed += 1
            queue.put((rank, i, f"{type(err).__name__}: {str(err)[:200]}"))
    queue.put((rank, "done", failed))


def main(size: int, rounds: int) -> None:
    store = host_rendezvous("127.0.0.1", size, 30.0)
    worlds = [uuid.uuid4().hex[:8] for _ in range(rounds)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=member, args=(r, size, store.port, worlds, queue)) for r in range(size)]
    for p in procs:
        p.start()
    done: dict[int, int] = {}
    while len(done) < size:
        rank, what, value = queue.get(timeout=rounds * TIMEOUT_S)
        if what == "done":
            done[rank] = value
        else:
            print(f"member {rank}, world {what}: {value}", flush=True)
    for p in procs:
        p.join()
    print(f"{rounds} worlds of {size} members; worlds failed per member: {dict(sorted(done.items()))}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
