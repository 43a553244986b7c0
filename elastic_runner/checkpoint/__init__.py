"""Checkpoints: the storage format with its atomic commit and verification on a filesystem or
an object store (:mod:`.storage`), the manager over ``dict[str, Stateful]`` (:mod:`.manager`, a
facade over one class per job: the cadence :mod:`.cadence`, the fenced commits
:mod:`.commit`, resume :mod:`.resume`, best weights :mod:`.best`, peer-state I/O
:mod:`.peer_state`, its events :mod:`.events`), the asynchronous save (:mod:`.async_save`) and
the fencing tokens that keep a stale writer out (:mod:`.fencing`)."""
