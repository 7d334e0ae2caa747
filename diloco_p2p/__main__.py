import sys

from diloco_p2p.cli import main

sys.exit(main())
