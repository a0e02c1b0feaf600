"""``python -m pp_train``: the training command (see `pp_train.command`)."""

import sys

from pp_train.command import main

sys.exit(main())
