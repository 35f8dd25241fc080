"""A policy version: what it is on disk, in the store and on the wire.

manifest.py    the typed Manifest (files, shards, the `delta` and `adapter` sections): checked once where bytes come in
               (`parse_manifest`: signature first, then shape), encoded once where it goes out, its signed bytes
checkpoint.py  the store layout of a run's versions, manifests written last; publishing, reading, pruning, verifying
signing.py     ed25519 manifest signatures (the trainer signs; relays, workers and the verifier check)
chain.py       delta versions: which version builds on which, what each route downloads, retention
codec.py       the delta file format: one checkpoint file rebuilt from its base (numpy, zstandard)
adapter.py     LoRA versions: the adapter's files, the identity of the base it applies to, the base check
publish.py     the trainer's side: publish each version whole, as a delta against the previous one, or both
store.py       the checkpoint store seam (a directory or an S3 bucket), keys checked once
The transfer (fetch, relay, rebuild from a held base) is rlfleet/services/shardcast; it reads manifests
only through manifest.py and relays need only chain.py's retention rule.
"""
