"""``python -m lightning_pipe.plan``: see :mod:`lightning_pipe.plan._cli`."""

import sys

from lightning_pipe.plan._cli import main

sys.exit(main())
