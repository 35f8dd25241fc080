"""The rules the whole fleet's work follows, read and written by several services that never import each other.

window.py         the async window: how many versions old a group may be and still be verified, trained, kept
reputation.py     each worker's verdict counters and its ban record (the verifier writes, the ingest reads)
assignment.py     run-assigned work: the run, not the worker, picks each group's task and seed
repeats.py        groups workers held back because the trainer would drop them (repeats, flat groups)
prompt_filter.py  the online prompt filter: prompts the trainer retired, which workers stop drawing
Each keeps its state in the run's Redis under a key of `RunKeys` (rlfleet/wire/streams.py). Nothing here imports
a service, the operator or the local runtime.
"""
