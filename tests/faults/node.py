"""A training node with the fault tests' injection: ``python -m tests.faults.node train ARGS`` is
``python -m diloco_p2p train ARGS`` with the faults that ``DILOCO_P2P_FAULTS``,
``DILOCO_P2P_START_GATE`` and ``DILOCO_P2P_CORRUPT_SHARDS`` plan installed at the product's hook
points (`tests.faults.injection`). A node started as ``python -m diloco_p2p`` reads none of them."""

import sys

from diloco_p2p.cli import main
from tests.faults.injection import install_from_env

install_from_env()
sys.exit(main())
