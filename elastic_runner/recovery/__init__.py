"""In-place recovery, the workers' side and the protocol both sides share: the one interface a
training loop gives it (:mod:`.recoverable`), where the job's
recovery store lives (:mod:`.store`) and a worker's client that follows it (:mod:`.store_client`),
the worker's recovery composed (:mod:`.inplace`) from a generation's group (:mod:`.group_formation`),
the recovery after a failed collective (:mod:`.failure`), nodes that leave and join at a step
boundary (:mod:`.node_changes`, with the store's records in :mod:`.membership`), the signals to
the agents (:mod:`.signals`) and the watch for a newer generation (:mod:`.generation_watch`);
cutting a broken group's connections (:mod:`.group_sockets`), the heartbeat an agent watches
(:mod:`.heartbeat`) and a script's FSDP2 model moved to the re-formed group
(:mod:`.fsdp_reattach`)."""
