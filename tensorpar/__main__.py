import sys

from tensorpar.cli import main

sys.exit(main())
