"""Everything elastic-runner relies on in torch's private behaviour, listed and checked here:
one module per area of torch (``rendezvous``, ``agent``, ``ddp``, ``fsdp``, ``dcp``,
``optimizers``), each declaring its fixes (numbered 1 to 16; docs refer to "fix N") beside the
code they check and the docstring that explains them; ``registry`` assembles them into
``FIXES`` and runs the start-up check (``check_torch``); ``fix`` defines a fix and how one is
judged. Policies that patch torch live with the agent (``agent/``), recovery behaviour with
the recovery (``recovery/``); only their checks and private-name reads are here.

To register a fix: in its area module, write its check (None, or what changed in torch),
declare ``FIX_X = Fix(name, roles, required, check, without, internals)`` listing every private
torch name it relies on, add it to that module's ``FIXES``, and gate what it serves on
``applies(FIX_X)``; a new area module goes into ``registry.FIXES``.
"""
