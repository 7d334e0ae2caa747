"""diloco-p2p: volunteer DiLoCo training over a Hivemind DHT."""

__version__ = "0.1.0"
