import sys

from freetoken_jax.cli import main

sys.exit(main())
