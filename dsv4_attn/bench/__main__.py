"""``python -m dsv4_attn.bench``: the same as ``dsv4-attn bench``."""

import sys

from .cli import main

sys.exit(main())
