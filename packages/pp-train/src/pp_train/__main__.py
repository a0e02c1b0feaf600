"""``python -m pp_train``: the training command (see `pp_train.app.command`)."""

import sys

from pp_train.app.command import main

sys.exit(main())
