"""Training, one rank's side: the step protocol any loop follows (:mod:`.session`: the built-in
trainer of :mod:`elastic_runner.trainer` and a user's own loop alike) and its parts (the
per-step vote, the stop policy and early stopping, the state that survives a restart, the
callback events, the straggler timing the logging step exchanges, fault injection, a rank's
expected endings and their exit codes)."""
