"""What an operator sees: per-rank Prometheus series (:mod:`.metrics`), the node's HTTP
endpoint and its series (:mod:`.health`, :mod:`.node_metrics`), the built-in reporting
callbacks (:mod:`.reporting`), goodput (:mod:`.goodput`) and the hang watchdog
(:mod:`.watchdog`). The straggler timing belongs to the step protocol
(:mod:`elastic_runner.train.straggler`); its gauge is in :mod:`.metrics`."""
