import os
import sys

from tensorpar.runtime.forking import start_early

start_early(sys.argv[1:])  # the ranks' fork server imports torch while this process does too
from tensorpar.cli import main  # noqa: E402

code = main()
if "TORCHELASTIC_RUN_ID" in os.environ:
    # Under torchrun the process group is already destroyed here; leave without the interpreter's
    # teardown, in which gloo's threads now and then abort the process ("terminate called without
    # an active exception") after a run that succeeded. Everything is written and closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
