"""The agent: the launching process of one node (``elastic-runner run``) that outlives its
workers. It starts them through torch.distributed.run (:mod:`.launch`), each forked from the
node's fork server (:mod:`.worker_start`, :mod:`.fork_server`), replaces a failed one
in place from a warm spare (:mod:`.inplace_agent`, composing :mod:`.spares`,
:mod:`.hang_watch`, :mod:`.replacement`, :mod:`.node_membership`, :mod:`.joins` and
:mod:`.store_failover` over :mod:`.node_attempt`) over the job's recovery store (:mod:`.store`),
decides which failures spend the restart budget (:mod:`.restart_budget`), names the rank that
died first when every worker restarts (:mod:`.first_death`), rides out an outage of the
rendezvous backend (:mod:`.rendezvous_outage`) and checks an etcd rendezvous backend before it
starts (:mod:`.etcd_check`)."""
