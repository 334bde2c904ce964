"""Imported last by the test workers' forkserver (tests/dist/harness.py): what the server imported is moved out of
the garbage collector's reach (``gc.freeze``) before it forks any worker.

Why: a worker collects garbage in ``Varuna(...)`` (util/heap.py), and a collection in a forked child walks every
object it inherited (torch, transformers: ~350k), writing to each one's header, which also copies every page of
the server's heap into the child. Frozen, they are skipped; what the worker itself makes is collected as before.
This is what the ``gc.freeze`` documentation prescribes for a process that forks without exec."""

import gc

gc.collect()
gc.freeze()
