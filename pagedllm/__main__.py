"""`python -m pagedllm ...` is the `pagedllm` command."""

import sys

from .entrypoints.cli import main

sys.exit(main())
