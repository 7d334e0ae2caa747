"""Reaching peers: the DHT and its p2pd, an event loop, reachability, stream framing.

The hivemind DHT and its p2pd (`dht`), the background event loop (`runner`), whether others can
dial us (`reach`), and the framing of our libp2p streams (`streams`).
"""
