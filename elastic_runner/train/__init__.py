"""Training, one rank's side: the step protocol any loop follows (:mod:`.session`) and its
parts (the step engine, the per-step vote, the stop policy and early stopping, the state that
survives a restart, the callback events, fault injection), and the built-in trainer
(:mod:`.loop`) with its assembly from a config (:mod:`.build`)."""
