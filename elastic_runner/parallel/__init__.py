"""How the model is spread over the ranks: DDP replicas or FSDP2 shards (``distributed.strategy``),
behind one interface (:class:`~elastic_runner.parallel.base.Parallelism`)."""
