"""What a node believes of its peers: signed entries, validated values, admission, refusals.

DHT entries signed by the peer they are about (`signing`), the validators of their values
(`schema`), a closed run's admission (`admission`), and every refusal of a peer logged and
counted (`guard`). How and why: docs/protocol/records.md, docs/threat-model.md.
"""
