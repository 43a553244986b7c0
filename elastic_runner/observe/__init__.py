"""What an operator sees: per-rank Prometheus series (:mod:`.metrics`), the node's HTTP
endpoint and its series (:mod:`.health`, :mod:`.node_metrics`), the built-in reporting
callbacks (:mod:`.reporting`), goodput (:mod:`.goodput`), stragglers (:mod:`.straggler`) and
the hang watchdog (:mod:`.watchdog`)."""
