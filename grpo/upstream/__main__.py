"""`python -m grpo.upstream install | check | manifest` (grpo/upstream/pin.py)."""

import sys

from grpo.upstream.pin import main

sys.exit(main())
