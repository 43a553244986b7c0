"""In-place recovery, the workers' side and the protocol both sides share: where the job's
recovery store lives (:mod:`.store`), generations and the replacement joining a running group
(:mod:`.inplace`), nodes that leave and join (:mod:`.membership`), cutting a broken group's
connections (:mod:`.group_sockets`) and the heartbeat an agent watches (:mod:`.heartbeat`)."""
