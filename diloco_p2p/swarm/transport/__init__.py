"""Reaching peers: the hivemind DHT and its p2pd (`dht`), the background event loop (`runner`),
whether others can dial us (`reach`), and the framing of our libp2p streams (`streams`)."""
