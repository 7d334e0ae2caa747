"""One module per `diloco-p2p` subcommand: each adds its own arguments (`add_parser`) and runs
(`run`), so `diloco_p2p.cli` only parses and dispatches."""

from diloco_p2p.commands import admit, demo, export, fetch, prepare, seed, simulate, status, train

COMMANDS = (train, seed, status, fetch, export, demo, prepare, simulate, admit)
