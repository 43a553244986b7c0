"""The built-in trainer, one rank's side: its step engine (:mod:`.engine`: forward/backward,
accumulation, autocast, clipping, the optimizer and scheduler steps), its loop with evaluation
and in-place recovery (:mod:`.loop`) and its assembly from a config (:mod:`.build`). It follows
the step protocol of :mod:`elastic_runner.train` like a user's own loop
(:mod:`elastic_runner.own_loop`) does; nothing below it imports it."""
