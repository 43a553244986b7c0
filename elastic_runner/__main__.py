import logging
import os
import sys
import traceback

from .cli import main


def _leave(code: int) -> None:
    # a worker is done (its checkpoint committed or its error recorded, files closed): skip
    # the interpreter's teardown of torch and the data libraries, ~1 s on a small machine,
    # which the agent waits for before it can restart the group or a peer can notice
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if sys.argv[1:2] != ["train"]:
    sys.exit(main())
try:
    code = main()
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
except BaseException:  # already in torchelastic's error file (worker._train is @record)
    traceback.print_exc()
    code = 1
_leave(code)
