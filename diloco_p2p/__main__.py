"""`python -m diloco_p2p`: the same command line as `diloco-p2p`."""

import sys

from diloco_p2p.cli import main

sys.exit(main())
