import logging
import os
import sys

from .cli import main


def _leave(code: int) -> None:
    # a worker is done (its checkpoint committed, files closed): skip
    # the interpreter's teardown of torch and the data libraries, ~1 s on a small machine,
    # which the agent waits for before it can restart the group or a peer can notice
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if sys.argv[1:2] != ["train"]:
    sys.exit(main())
# an unexpected exception still ends with the normal teardown: torchelastic's root-cause
# reporting of a failed group was seen to change when failing workers left at once
_leave(main())
