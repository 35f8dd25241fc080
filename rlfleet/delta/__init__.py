"""Delta versions: a policy version sent as what changed since the one before it.

chain.py    the manifest's `delta` section, which version builds on which, retention (no dependencies)
codec.py    the delta file format: one checkpoint file rebuilt from its base (numpy, zstandard)
publish.py  the trainer's side: publish each version whole or as a delta against the previous one
The client's side (fetch, rebuild, verify) is rlfleet/services/shardcast/assemble.py; relays and the
origin treat delta files as ordinary files and need none of this but chain.py's retention rule.
"""
