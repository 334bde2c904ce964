"""Development tools shared by the tests and the benchmarks: test hosts reachable over real SSH
(:mod:`.testhosts`), running ``varuna launch`` and reading what it recorded (:mod:`.launching`), and injecting
faults into a running job (:mod:`.chaos`). Never imported by the library; not installed with it."""
