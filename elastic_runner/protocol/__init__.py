"""Everything agents and workers say to each other through the recovery store and the
environment, in one place: the store's keys behind typed operations (:mod:`.keys`), the
generation announcement (:mod:`.announcement`), the store clients' base (:mod:`.client`),
every ``ELASTIC_RUNNER_*`` variable (:mod:`.env`), torchrun's environment (:mod:`.torchrun_env`)
and setting the environment for a block (:mod:`.scoped_env`). Nothing outside this package
builds a store key or names one of these variables.

The modules are imported one by one (``from elastic_runner.protocol.env import ...``): the
environment's modules import no torch.
"""
