"""`python -m planner`: pd-planner."""

import sys

from .cli import main

sys.exit(main())
