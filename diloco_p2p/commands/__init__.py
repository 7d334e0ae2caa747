"""One module per `diloco-p2p` subcommand, each with its arguments and its run.

Each adds its own arguments (`add_parser`) and runs (`run`), so `diloco_p2p.cli` only parses and
dispatches.
"""

from diloco_p2p.commands import (
    admit,
    demo,
    export,
    fetch,
    fetch_data,
    plan,
    prepare,
    seed,
    simulate,
    status,
    train,
)

COMMANDS = (train, seed, status, fetch, fetch_data, export, demo, prepare, simulate, admit, plan)
