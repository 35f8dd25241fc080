"""`rlfleet ingest`: authenticated HTTP front of the rollout inbox for workers outside the cluster."""
