"""`python -m freetoken_jax.convert SRC DST [--dtype bf16|f32] [--shard-gib N]`."""

import sys

from freetoken_jax.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main())
