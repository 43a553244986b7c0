"""The names of a sharded (DCP) checkpoint's files and state keys, without DCP itself: what the
storage layer checks of a manifest and a directory listing. Importing DCP (it loads DTensor's
operator tables) took 0.6 s of every ``elastic-runner run`` agent's start here, which never
reads a shard; :mod:`elastic_runner.checkpoint.dcp_format` holds everything that needs DCP."""

from __future__ import annotations

import re

METADATA = ".metadata"
SHARD_FILE = re.compile(r"^__(?P<rank>\d{1,6})_(?P<n>\d{1,6})\.distcp$")
SHARDED_KEYS = ("model", "optimizer")  # what DCP holds; the rest stays in state.pt
