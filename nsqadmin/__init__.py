"""nsqadmin: the web UI and JSON API of the cluster (README.md)."""
