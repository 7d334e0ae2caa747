"""What a node believes of its peers: DHT entries signed by the peer they are about (`signing`),
the validators of their values (`schema`), a closed run's admission (`admission`), and every
refusal of a peer logged and counted (`guard`)."""
