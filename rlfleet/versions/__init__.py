"""A policy version: what it is on disk, in the store and on the wire.

store.py       the checkpoint store seam (a directory or an S3 bucket), keys checked once
checkpoint.py  the store layout of a run's versions, manifests written last, reading and verifying them
signing.py     ed25519 manifest signatures (the trainer signs; relays, workers and the verifier check)
chain.py       delta versions in manifests: the signed `delta` section, which version builds on which, retention
codec.py       the delta file format: one checkpoint file rebuilt from its base (numpy, zstandard)
publish.py     the trainer's side: publish each version whole, as a delta against the previous one, or both
The client's side of a transfer (fetch, rebuild, verify) is rlfleet/services/shardcast/assemble.py;
relays and the origin treat delta files as ordinary files and need only chain.py's retention rule.
"""
