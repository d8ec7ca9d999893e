"""`python -m nsqadmin`: the same as the `nsqadmin` console script."""

import sys

from .main import main

sys.exit(main())
