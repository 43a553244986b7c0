"""Checkpoints: the storage format with its atomic commit and verification on a filesystem or
an object store (:mod:`.storage`), the manager over ``dict[str, Stateful]`` (:mod:`.manager`:
cadence, best, retention, resume, rollback), the asynchronous save (:mod:`.async_save`) and
the fencing tokens that keep a stale writer out (:mod:`.fencing`)."""
