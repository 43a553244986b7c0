"""The agent: the launching process of one node (``elastic-runner run``) that outlives its
workers. It starts them through torch.distributed.run (:mod:`.launch`), replaces a failed one
in place from a warm spare (:mod:`.inplace_agent`) over the job's recovery store
(:mod:`.store`), decides which failures spend the restart budget (:mod:`.restart_budget`) and
checks an etcd rendezvous backend before it starts (:mod:`.etcd_check`)."""
