"""A deterministic fault simulator for the replication core (see README.md)."""
