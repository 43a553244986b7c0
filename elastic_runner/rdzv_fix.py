"""Moved: the rendezvous fixes live in :mod:`elastic_runner.compat` (fixes 1 and 2 there).

The stale-bootstrap-store patch is gone: ``elastic-runner run`` sets torch's own switch
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` instead (:data:`elastic_runner.compat.RDZV_SWITCHES`);
:func:`apply` now installs only the rendezvous-backend outage tolerance. Kept for old imports.
"""

from __future__ import annotations

from .compat import apply_rendezvous_fixes as apply

__all__ = ["apply"]
