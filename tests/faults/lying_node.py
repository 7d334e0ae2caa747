"""A training node whose reducer can lie, for the fault tests: ``python -m tests.faults.lying_node
train ARGS`` is ``python -m diloco_p2p train ARGS`` with `tests.faults.lying.LyingAllreduce`
installed as the all-reduce a planned reducer lie uses (``scale@reduce:R``, ``split@reduce:R`` in
``DILOCO_P2P_FAULTS``, `diloco_p2p.faults`). The product itself has no lying all-reduce."""

import sys

from diloco_p2p import faults
from diloco_p2p.cli import main
from tests.faults.lying import LyingAllreduce

faults.lying_reducer = LyingAllreduce
sys.exit(main())
