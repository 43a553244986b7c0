"""The environment variables through which ``elastic-runner run script.py`` (and a user, for
drills) configures the runner's parts of a script's loop: read by
:func:`elastic_runner.fault_tolerant` and :func:`elastic_runner.init_distributed` in every
worker, spare and restart, since they inherit the agent's environment."""

TRACE_DIR_ENV = "ELASTIC_RUNNER_TRACE_DIR"
"""``run script.py --trace-samples DIR``: the sample trace's directory (over
``fault_tolerant``'s ``trace_dir``)."""

NO_RESUME_ENV = "ELASTIC_RUNNER_NO_RESUME"
"""``run script.py --no-resume``: ``1``: the job's first attempt starts from step 0 whatever
``checkpoint_dir`` holds (its restarts resume what it wrote)."""

CHECKPOINT_DIR_FILE_ENV = "ELASTIC_RUNNER_CHECKPOINT_DIR_FILE"
"""``run script.py``: a file of the agent's into which each node's local rank 0 writes the
``checkpoint_dir`` its ``fault_tolerant`` loop was given (one line, absolute unless a URL), so
that the agent's crash-loop rule sees checkpoints committed between two failures."""

RECOVERY_ENV = "ELASTIC_RUNNER_RECOVERY"
"""A script's ``recovery`` settings (a YAML mapping of the ``recovery`` section's keys, e.g.
``{heartbeat_timeout_seconds: 5}``), read by ``run`` and by its workers alike."""

FAULTS_ENV = "ELASTIC_RUNNER_FAULTS"
"""Fault drills: a YAML list of fault specs (the ``faults.inject`` entries)."""

FAULTS_TRIGGER_ENV = "ELASTIC_RUNNER_FAULTS_TRIGGER"
"""Fault drills: a trigger file (``faults.trigger_file``)."""
