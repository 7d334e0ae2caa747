"""Who averages with whom: forming a round's group (`matchmaking`, its pure rules in `grouping`),
the signed progress records each node publishes (`records`) and the resync policy read from them
(`resync`)."""
