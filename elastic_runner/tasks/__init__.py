"""Built-in tasks (``digits``, ``char_lm``) and the task interface (:mod:`.base`)."""
